-- One service's database and its roles, with least privilege (docs/operations.md, "Deploying
-- against managed Postgres and RabbitMQ"). A DBA runs it once per service, as a role that may
-- create roles and databases (on a managed server, its administrator role):
--
--   psql "$ADMIN_URL" -v service=inventory \
--        -v owner_password="$(cat inventory_owner.pw)" -v runtime_password="$(cat inventory.pw)" \
--        -v relay=relay -v relay_password="$(cat relay.pw)" -f ops/postgres/roles.sql
--
-- It makes, if missing:
--   <service>_owner  LOGIN; owns the database and every table the migrations create. The service
--                    migrates as this role (MIGRATION_DATABASE_URL) and grants the relay its
--                    rights on the outbox (OUTBOX_RELAY_ROLE).
--   <service>        LOGIN; the runtime role (DATABASE_URL): SELECT, INSERT, UPDATE and DELETE on
--                    the tables, USAGE on their sequences, nothing else. No CREATE anywhere, no
--                    TRUNCATE, not superuser, no CREATEDB, no CREATEROLE.
--   <relay>          LOGIN (default name `relay`), shared by every service's database: CONNECT and
--                    USAGE here, and SELECT, UPDATE, DELETE on the outbox alone.
--   <books>          LOGIN (default name `books`), shared by every service's database: CONNECT,
--                    USAGE and SELECT on the tables, for the orders service's check of the books
--                    (BOOKS_INVENTORY_URL, BOOKS_BILLING_URL) and `msgctl books`. Reads only.
--   <service>        the database, owned by <service>_owner; CONNECT revoked from PUBLIC, so no
--                    other service's role can even connect to it.
-- Passwords are optional (-v ..._password=...): without one, a role keeps what it has (none,
-- for certificate or IAM authentication). Safe to run again: it only adds what is missing.

\set ON_ERROR_STOP on
\if :{?service}
\else
  \echo 'roles.sql: set the service, e.g. psql -v service=inventory -f ops/postgres/roles.sql'
  \quit
\endif
\if :{?relay}
\else
  \set relay relay
\endif
\if :{?owner_password}
\else
  \set owner_password ''
\endif
\if :{?runtime_password}
\else
  \set runtime_password ''
\endif
\if :{?relay_password}
\else
  \set relay_password ''
\endif
\if :{?books}
\else
  \set books books
\endif
\if :{?books_password}
\else
  \set books_password ''
\endif
\set owner :service'_owner'

-- The roles: logins with nothing more.
select format('create role %I login nosuperuser nocreatedb nocreaterole', r)
  from unnest(array[:'owner', :'service', :'relay', :'books']) as r
 where not exists (select from pg_roles where rolname = r)
\gexec
select format('alter role %I password %L', r, p)
  from (values (:'owner', :'owner_password'), (:'service', :'runtime_password'), (:'relay', :'relay_password'),
               (:'books', :'books_password')) as v(r, p)
 where p <> ''
\gexec

-- The database, owned by the migrating role; only this service's roles, the relay and the books'
-- reader connect.
select format('create database %I owner %I', :'service', :'owner')
 where not exists (select from pg_database where datname = :'service')
\gexec
select format('revoke all on database %I from public', :'service')
\gexec
select format('grant connect on database %I to %I, %I, %I, %I', :'service', :'owner', :'service', :'relay', :'books')
\gexec

\connect :service
-- Postgres 15 and later: the public schema belongs to the database's owner and PUBLIC may not
-- create in it. Said again for servers upgraded from older releases.
revoke create on schema public from public;
select format('grant usage on schema public to %I, %I, %I', :'service', :'relay', :'books')
\gexec
-- Every table and sequence the owner creates from now on (the migrations), and those it already
-- has (a run after the first migration).
select format('alter default privileges for role %I in schema public grant select, insert, update, delete on tables to %I',
              :'owner', :'service')
\gexec
select format('alter default privileges for role %I in schema public grant usage, select on sequences to %I',
              :'owner', :'service')
\gexec
select format('grant select, insert, update, delete on all tables in schema public to %I', :'service')
\gexec
select format('alter default privileges for role %I in schema public grant select on tables to %I', :'owner', :'books')
\gexec
select format('grant select on all tables in schema public to %I', :'books')
\gexec
select format('grant usage, select on all sequences in schema public to %I', :'service')
\gexec
select format('grant select, update, delete on outbox to %I', :'relay')
 where to_regclass('public.outbox') is not null
\gexec
