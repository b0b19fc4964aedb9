-- Ordering per key, its two holes closed (decision 0024):
--
-- 1. An endpoint that takes only some of a key's types. The outbox numbers a key's messages
--    across every type, so an endpoint that takes `order.placed` (place 1) and `order.ended`
--    (place 3) but not `order.deadline` (place 2) would wait for place 2 for ever. Each message now
--    also carries, for every type, the place of its key's latest earlier message of that type
--    (`ordering_earlier`); an endpoint waits only for the latest of those it takes.
-- 2. A message parked before its turn (unreadable on arrival, or past the crash bound) could not
--    give up its place: the key was not there yet, so nothing moved, and when the key got there it
--    waited for it for ever. Such a place is now written down (`inbox_key_given_up`), and the key
--    steps over it when it gets there.
--
-- And both sides' tables are kept for their retention, not for ever: a key is an entity with a
-- bounded life (an order), and a row per key is otherwise a row per order for good.

-- Producer side: for each key, the place its latest message of each type took. A key numbered
-- before this migration has none (null), and its messages go on without `ordering_earlier`: its
-- endpoints cannot know which types its earlier messages were, so each message follows the place
-- just before its own, as before. Only keys new from here on carry the map.
alter table outbox_key_sequences
    add column latest jsonb,
    add column numbered_at timestamptz not null default now();
create index outbox_key_sequences_numbered_at on outbox_key_sequences (numbered_at);

create or replace function outbox_number_by_key() returns trigger language plpgsql as $$
declare
    k text := new.headers->>'ordering_key';
    place bigint;
    earlier jsonb;
begin
    -- The key's row, new or not, stays locked until the producing transaction ends: places follow
    -- commit order. (A loop, because retention may delete the row between the two statements.)
    loop
        insert into outbox_key_sequences (key, last, latest) values (k, 1, jsonb_build_object(new.message_type, 1))
            on conflict do nothing;
        if found then
            place := 1;
            earlier := '{}'::jsonb;
            exit;
        end if;
        select s.last + 1, s.latest into place, earlier from outbox_key_sequences s where s.key = k for update;
        if found then
            update outbox_key_sequences s
               set last = place, latest = earlier || jsonb_build_object(new.message_type, place), numbered_at = now()
             where s.key = k;
            exit;
        end if;
    end loop;
    new.headers := new.headers || jsonb_build_object('ordering_seq', place);
    if earlier is not null then
        new.headers := new.headers || jsonb_build_object('ordering_earlier', earlier);
    end if;
    return new;
end;
$$;

-- Consumer side.
alter table inbox_key_positions add column moved_at timestamptz not null default now();
create index inbox_key_positions_moved_at on inbox_key_positions (moved_at);

-- Places given up before the key got to them: the message at `seq`, whose latest earlier message
-- of a type the endpoint takes is at `follows`. When the key passes `follows`, it passes `seq` too.
create table inbox_key_given_up (
    endpoint     text        not null,
    key          text        not null,
    follows      bigint      not null,
    seq          bigint      not null,
    given_up_at  timestamptz not null default now(),
    primary key (endpoint, key, follows)
);
create index inbox_key_given_up_at on inbox_key_given_up (given_up_at);

-- Move `endpoint`'s `key` past place `seq`, and on past every place given up right after it. The
-- caller holds the key's row locked.
create function inbox_key_move_past(p_endpoint text, p_key text, p_seq bigint) returns void
language plpgsql as $$
declare
    passed bigint := p_seq;
    skipped bigint;
begin
    loop
        delete from inbox_key_given_up g
         where g.endpoint = p_endpoint and g.key = p_key and g.follows = passed
        returning g.seq into skipped;
        exit when not found;
        passed := skipped;
    end loop;
    update inbox_key_positions p set next = passed + 1, moved_at = now()
     where p.endpoint = p_endpoint and p.key = p_key;
end;
$$;

-- The turn of the message at place `seq` of `key` at `endpoint`, whose latest earlier message of a
-- type the endpoint takes is at `follows` (0: none): its key's row is created at place 1 if it has
-- none and locked until the transaction ends; if every place before `seq` that the endpoint waits
-- for is passed (the key is in `follows + 1 ..= seq`), the key moves past `seq`. Returns the key's
-- next place as it was before: the caller tells its turn from that.
create function inbox_take_turn(p_endpoint text, p_key text, p_seq bigint, p_follows bigint) returns bigint
language plpgsql as $$
declare
    was bigint;
begin
    -- (A loop, because retention may delete the row between the two statements.)
    loop
        -- A new key is at place 1: past it already if this message follows nothing.
        insert into inbox_key_positions (endpoint, key, next)
            values (p_endpoint, p_key, case when p_follows = 0 then p_seq + 1 else 1 end)
            on conflict do nothing;
        if found then
            return 1;
        end if;
        select p.next into was from inbox_key_positions p
         where p.endpoint = p_endpoint and p.key = p_key for update;
        exit when found;
    end loop;
    if was > p_follows and was <= p_seq then
        perform inbox_key_move_past(p_endpoint, p_key, p_seq);
    elsif was > p_seq then
        -- Late: the key stays, but it is in use, which retention must know.
        update inbox_key_positions p set moved_at = now() where p.endpoint = p_endpoint and p.key = p_key;
    end if;
    return was;
end;
$$;

-- Give up the place `seq` of a message being parked: if it is the key's turn, the key moves past
-- it now; if the key is not there yet, it will step over it when it gets there; if the key is
-- already past it, nothing changes.
create function inbox_give_up_place(p_endpoint text, p_key text, p_seq bigint, p_follows bigint) returns void
language plpgsql as $$
declare
    was bigint := inbox_take_turn(p_endpoint, p_key, p_seq, p_follows);
begin
    if was <= p_follows then
        insert into inbox_key_given_up (endpoint, key, follows, seq) values (p_endpoint, p_key, p_follows, p_seq)
            on conflict do nothing;
    end if;
end;
$$;
