-- Ordering per key (decision 0017): an endpoint may apply the messages of one key (an order id,
-- say) in the order their outbox rows committed, across retries and consumer instances.

-- Producer side: the last place given to each key in this database's outbox. A row whose headers
-- name an `ordering_key` takes the next place at insert, from a row of this table that stays
-- locked until its transaction ends: two transactions writing for one key take their places in
-- the order they commit. Rows without a key do not fire the trigger.
create table outbox_key_sequences (
    key   text   primary key,
    last  bigint not null
);

create function outbox_number_by_key() returns trigger language plpgsql as $$
declare
    place bigint;
begin
    insert into outbox_key_sequences as s (key, last) values (new.headers->>'ordering_key', 1)
        on conflict (key) do update set last = s.last + 1
        returning last into place;
    new.headers := new.headers || jsonb_build_object('ordering_seq', place);
    return new;
end;
$$;

create trigger outbox_number_by_key before insert on outbox
    for each row when (new.headers ? 'ordering_key') execute function outbox_number_by_key();

-- Consumer side: for each ordered endpoint and key, the place it applies next. Moved in the same
-- transaction as the message's inbox row and effect.
create table inbox_key_positions (
    endpoint  text   not null,
    key       text   not null,
    next      bigint not null,
    primary key (endpoint, key)
);
