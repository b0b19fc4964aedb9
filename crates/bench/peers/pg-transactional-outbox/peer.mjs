// pg-transactional-outbox (npm) as a peer relay for the bench (crates/bench/src/peers.rs).
//
//   node peer.mjs fill  DATABASE_URL ROWS_FILE
//   node peer.mjs relay DATABASE_URL AMQP_URL QUEUE defaults|tuned
//
// `fill` creates the library's own outbox table, its polling function and its indexes (the SQL of
// its `DatabaseSetup`), and writes one message per line of ROWS_FILE (JSON: the payload as text
// and the headers, the very rows our relay drains) through the library's own message storage, 500
// to a transaction, as an application would.
//
// `relay` runs the library's polling listener (`initializePollingMessageListener`) with a message
// handler that publishes each message through amqplib's confirm channel to QUEUE (declared by the
// bench as a quorum queue) and returns once the broker has confirmed it; the library then marks
// the message processed in the transaction it opened for it. It runs until it is stopped; the
// bench times it by the queue's depth.
//
// The library also reads new rows from the WAL by logical replication, which needs the server's
// `wal_level = logical`; the bench's Postgres is shared with everything else on the machine and
// runs `replica`, so the polling listener is the one measured.
//
// `defaults`: none of its tuning settings given (batches of 5; while fewer are in progress, at most
// 500 ms until the next poll) and messages stored as the library stores them unless told otherwise
// (no segment, `sequential`: one at a time, in order). Both runs turn its attempt protections off,
// as its README configures an outbox. `tuned`: messages marked `parallel` (each row is an order of its own, so no order is
// lost), batches of 64, a poll every 10 ms, and handler connections enough for a batch.

import { readFileSync } from 'node:fs';
import process from 'node:process';

import amqp from 'amqplib';
import pg from 'pg';
import {
  DatabaseSetup,
  getDefaultLogger,
  initializeMessageStorage,
  initializePollingMessageListener,
} from 'pg-transactional-outbox';

const table = { outboxOrInbox: 'outbox', schema: 'public', table: 'outbox', nextMessagesName: 'next_outbox_messages' };
const settings = {
  dbSchema: table.schema,
  dbTable: table.table,
  nextMessagesFunctionName: table.nextMessagesName,
  // As the library's README configures an outbox: the relay retries a message until published.
  enableMaxAttemptsProtection: false,
  enablePoisonousMessageProtection: false,
  // No deletion of processed rows while the bench times the drain.
  messageCleanupIntervalInMs: 0,
};
const SETTINGS = {
  defaults: { settings: {}, handlerConnections: undefined, parallel: false },
  tuned: {
    settings: { nextMessagesBatchSize: 64, nextMessagesPollingIntervalInMs: 10 },
    handlerConnections: 66,
    parallel: true,
  },
};

function logger() {
  const log = getDefaultLogger('pg-transactional-outbox');
  log.level = 'warn';
  return log;
}

async function fill(databaseUrl, rowsFile) {
  const client = new pg.Client({ connectionString: databaseUrl });
  await client.connect();
  const setup = { ...table, database: new URL(databaseUrl).pathname.slice(1), listenerRole: 'postgres' };
  await client.query(DatabaseSetup.dropAndCreateTable(setup));
  await client.query(DatabaseSetup.createPollingFunction(setup));
  await client.query(DatabaseSetup.setupPollingIndexes(setup));
  const store = initializeMessageStorage({ outboxOrInbox: 'outbox', settings }, logger());
  const rows = readFileSync(rowsFile, 'utf8')
    .split('\n')
    .filter((line) => line.length > 0)
    .map((line) => JSON.parse(line));
  for (let start = 0; start < rows.length; start += 500) {
    await client.query('BEGIN');
    for (const { payload, headers } of rows.slice(start, start + 500)) {
      await store(
        {
          id: headers['message-id'],
          aggregateType: 'order',
          aggregateId: headers.correlation_id ?? headers['message-id'],
          messageType: headers['message-type'],
          payload: JSON.parse(payload),
          metadata: headers,
        },
        client,
      );
    }
    await client.query('COMMIT');
  }
  await client.end();
  console.log(`filled ${rows.length}`);
}

async function relay(databaseUrl, amqpUrl, queue, setting) {
  const tuning = SETTINGS[setting];
  if (!tuning) throw new Error(`no setting ${setting}: defaults or tuned`);
  if (tuning.parallel) {
    const client = new pg.Client({ connectionString: databaseUrl });
    await client.connect();
    await client.query(`UPDATE ${table.schema}.${table.table} SET concurrency = 'parallel'`);
    // The update leaves a dead version of every row; vacuumed, the polling function does not
    // step over them, as it would not on rows stored `parallel` in the first place.
    await client.query(`VACUUM ANALYZE ${table.schema}.${table.table}`);
    await client.end();
  }
  const connection = await amqp.connect(amqpUrl);
  const channel = await connection.createConfirmChannel();
  const publisher = {
    // Resolves once the broker confirms the message; a nack or a closed channel rejects, and the
    // library tries the message again.
    handle: (message) =>
      new Promise((resolve, reject) => {
        const body = Buffer.from(JSON.stringify(message.payload));
        const properties = {
          persistent: true,
          messageId: message.id,
          type: message.messageType,
          contentType: 'application/json',
          headers: message.metadata ?? {},
        };
        channel.publish('', queue, body, properties, (error) => (error ? reject(error) : resolve()));
      }),
  };
  const dbListenerConfig = { connectionString: databaseUrl };
  const dbHandlerConfig = { connectionString: databaseUrl, max: tuning.handlerConnections };
  const [shutdown] = initializePollingMessageListener(
    { outboxOrInbox: 'outbox', dbListenerConfig, dbHandlerConfig, settings: { ...settings, ...tuning.settings } },
    publisher,
    logger(),
  );
  console.log('relaying');
  await new Promise((resolve) => {
    process.once('SIGTERM', resolve);
    process.once('SIGINT', resolve);
  });
  await shutdown();
  await channel.close();
  await connection.close();
}

const [command, ...args] = process.argv.slice(2);
const commands = { fill, relay };
if (!commands[command]) {
  console.error('usage: peer.mjs fill DATABASE_URL ROWS_FILE | relay DATABASE_URL AMQP_URL QUEUE defaults|tuned');
  process.exit(2);
}
await commands[command](...args);
