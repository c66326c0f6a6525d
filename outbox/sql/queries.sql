-- Named queries on the outbox table. Each starts with `-- name: <name>` and a line saying what
-- it does. {table} is the validated, schema-qualified table name; :params are bind parameters.

-- name: leased_behind_earlier
-- Of the rows of an immediate sender's batch (:ids), those that may not go yet: their key has
-- an earlier pending row that is not in this batch under the sender's live lease (a row of
-- another sender or of the relay, one being retried, one of this sender's own that waits in
-- its queue or whose lease ran out), so sending them now could overtake it. A row backing off
-- is found through the retry index. Other earlier rows are searched shard by shard along the
-- pending index, the way read_batch walks it (rows backing off, and the rows of their keys
-- behind them, are passed over), at most :reach of them per shard. A search that stops at
-- :reach rows holds back, too, every keyed row of the shard beyond where it stopped: the
-- backlog is deeper than was searched, and the relay sends it in order.
WITH mine AS (
    SELECT id, shard, seq, topic, key
      FROM {table}
     WHERE id = ANY(CAST(:ids AS uuid[]))),
reach AS (
    SELECT shard, max(seq) AS seq FROM mine GROUP BY shard),
elsewhere AS (
    SELECT p.shard, p.seq, p.topic, p.key
      FROM reach AS r
     CROSS JOIN LATERAL (
           SELECT EXISTS (
                  SELECT 1 FROM {table} AS f
                   WHERE f.status = 'pending' AND f.next_attempt_at > now()
                     AND f.shard = r.shard) AS backing_off) AS b
     CROSS JOIN LATERAL (
           SELECT q.shard, q.seq, q.topic, q.key
             FROM {table} AS q
            WHERE q.status = 'pending' AND q.shard = r.shard AND q.seq < r.seq
              AND NOT coalesce(q.id = ANY(CAST(:ids AS uuid[])) AND q.lease_owner = :owner
                               AND q.lease_until > now(), false)
              AND (q.next_attempt_at IS NULL OR q.next_attempt_at <= now())
              AND (NOT b.backing_off OR q.key IS NULL OR NOT EXISTS (
                  SELECT 1
                    FROM {table} AS f
                   WHERE f.status = 'pending' AND f.next_attempt_at > now()
                     AND f.shard = q.shard AND f.topic = q.topic AND f.key = q.key
                     AND f.seq < q.seq))
            ORDER BY q.seq
            LIMIT :reach) AS p),
searched AS (
    SELECT shard, count(*) AS rows, max(seq) AS last_seq FROM elsewhere GROUP BY shard)
SELECT m.id
  FROM mine AS m
  JOIN elsewhere AS e
    ON e.shard = m.shard AND e.topic = m.topic AND e.key = m.key AND e.seq < m.seq
UNION
SELECT m.id
  FROM mine AS m
  JOIN searched AS s
    ON s.shard = m.shard AND s.rows >= :reach AND m.seq > s.last_seq
 WHERE m.key IS NOT NULL
UNION
SELECT m.id
  FROM mine AS m
 WHERE EXISTS (
       SELECT 1
         FROM {table} AS f
        WHERE f.status = 'pending' AND f.next_attempt_at > now()
          AND f.shard = m.shard AND f.topic = m.topic AND f.key = m.key AND f.seq < m.seq);

-- name: clear_to_send
-- Immediate send: of the rows this sender leased when they were written, those it may send now,
-- oldest first, with the seconds left on their lease. Rows behind an earlier pending row of
-- their key that the sender does not hold (see leased_behind_earlier) are released to the
-- relay in the same statement.
WITH blocked AS ({leased_behind_earlier}),
released AS (
    UPDATE {table}
       SET lease_owner = NULL, lease_until = NULL
     WHERE id IN (SELECT id FROM blocked) AND lease_owner = :owner
    RETURNING id)
SELECT id, seq, shard, topic, key, value, content_type, header_names, header_values, attempts,
       created_at, generation, extract(epoch FROM lease_until - now()) AS lease_left
  FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[])) AND lease_owner = :owner AND status = 'pending'
   AND lease_until > now()
   AND id NOT IN (SELECT id FROM blocked)  -- (the release runs whether or not it is read)
 ORDER BY seq;

-- name: release
-- Give leased rows back, untouched, for the relay to send.
UPDATE {table}
   SET lease_owner = NULL, lease_until = NULL
 WHERE id = ANY(:ids) AND lease_owner = :owner;

-- name: mark_sent
-- Record Kafka's acknowledgement (partition, offset) of pending rows, of the generation that was
-- sent (a row requeued by repair meanwhile must go again). :owner, when given, is the immediate
-- sender that leased the rows; the relay passes NULL: it owns the rows' shards.
UPDATE {table} AS o
   SET status = 'sent',
       sent_at = now(),
       kafka_partition = acked.kafka_partition,
       kafka_offset = acked.kafka_offset,
       attempts = o.attempts + 1,
       lease_owner = NULL,
       lease_until = NULL,
       error_kind = NULL,
       last_error = NULL
  FROM unnest(CAST(:ids AS uuid[]), CAST(:partitions AS int[]), CAST(:offsets AS bigint[]),
              CAST(:generations AS int[]))
       AS acked (id, kafka_partition, kafka_offset, generation)
 WHERE o.id = ANY(CAST(:ids AS uuid[]))  -- lets the planner use the primary key
   AND o.id = acked.id AND o.status = 'pending' AND o.generation = acked.generation
   AND (CAST(:owner AS text) IS NULL OR o.lease_owner = :owner);

-- name: delete_sent
-- Keep-nothing retention: drop pending rows once Kafka acknowledged them (:owner as in
-- mark_sent).
DELETE FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'pending'
   AND (CAST(:owner AS text) IS NULL OR lease_owner = :owner);

-- name: purge_sent
-- Delete one batch of sent rows created and sent before the cutoff (the UUIDv7 id bounds
-- the creation time, so the primary key index finds them).
WITH doomed AS (
    SELECT id
      FROM {table}
     WHERE id < :cutoff_id
       AND status = 'sent'
       AND sent_at < :cutoff
     ORDER BY id
     LIMIT :batch_size
       FOR UPDATE SKIP LOCKED)
DELETE FROM {table} AS o
 USING doomed
 WHERE o.id = doomed.id;

-- name: read_batch
-- The next rows of the given shards that may go now, oldest first, for the relay that owns the
-- shards (it holds their advisory locks, so no row is written to keep other relays away).
-- A key whose earliest pending row cannot go now (backing off before a retry, or leased by an
-- immediate sender) is held back from that row on: later messages never overtake it.
-- Each shard's window is its first :window rows that could go: rows backing off, and the rows
-- of their keys behind them, are passed over (one probe of the small retry index per row), so
-- that a key with a deep backlog behind a failing message never fills the window by itself.
WITH window_rows AS (
    SELECT o.*
      FROM unnest(CAST(:shards AS smallint[])) AS s (shard)
     CROSS JOIN LATERAL (
           SELECT EXISTS (
                  SELECT 1 FROM {table} AS f
                   WHERE f.status = 'pending' AND f.next_attempt_at > now()
                     AND f.shard = s.shard) AS backing_off) AS r
     CROSS JOIN LATERAL (
           SELECT p.id, p.seq, p.shard, p.topic, p.key, p.value, p.content_type, p.header_names,
                  p.header_values, p.attempts, p.created_at, p.generation, p.lease_until
             FROM {table} AS p
            WHERE p.status = 'pending' AND p.shard = s.shard
              AND (p.next_attempt_at IS NULL OR p.next_attempt_at <= now())
              -- Probed only in a shard with rows backing off, and kept a probe per row by the
              -- OR (an anti join would compare each row with every row backing off).
              AND (NOT r.backing_off OR p.key IS NULL OR NOT EXISTS (
                  SELECT 1
                    FROM {table} AS f
                   WHERE f.status = 'pending' AND f.next_attempt_at > now()
                     AND f.shard = p.shard AND f.topic = p.topic AND f.key = p.key
                     AND f.seq < p.seq))
            ORDER BY p.seq
            LIMIT :window) AS o),
blockers AS (
    SELECT topic, key, min(seq) AS seq
      FROM window_rows
     WHERE key IS NOT NULL AND lease_until > now()
     GROUP BY topic, key)
-- (Columns in the order of outbox.rows.READ_COLUMNS; the id also as text, for its header.)
SELECT w.id, w.seq, w.shard, w.topic, w.key, w.value, w.content_type, w.header_names,
       w.header_values, w.attempts, w.created_at, w.generation, CAST(w.id AS text) AS id_text
  FROM window_rows AS w
  LEFT JOIN blockers AS b ON b.topic = w.topic AND b.key = w.key
 WHERE (w.lease_until IS NULL OR w.lease_until <= now())
   AND (b.seq IS NULL OR w.seq < b.seq)
 ORDER BY w.seq
 LIMIT :batch_size;

-- name: mark_retry
-- Record a failed attempt: back off until next_attempt_at, keep the error, give the row back.
UPDATE {table} AS o
   SET attempts = o.attempts + 1,
       next_attempt_at = now() + make_interval(secs => failed.delay),
       error_kind = failed.kind,
       last_error = failed.error,
       lease_owner = NULL,
       lease_until = NULL
  FROM unnest(CAST(:ids AS uuid[]), CAST(:delays AS float8[]), CAST(:kinds AS text[]),
              CAST(:errors AS text[])) AS failed (id, delay, kind, error)
 WHERE o.id = ANY(CAST(:ids AS uuid[]))  -- lets the planner use the primary key
   AND o.id = failed.id AND o.status = 'pending'
   AND (CAST(:owner AS text) IS NULL OR o.lease_owner = :owner);

-- name: mark_dead
-- Give up on rows: they stay, dead, with the reason, until an operator retries or purges them.
UPDATE {table} AS o
   SET status = 'dead',
       attempts = o.attempts + 1,
       error_kind = failed.kind,
       last_error = failed.error,
       lease_owner = NULL,
       lease_until = NULL
  FROM unnest(CAST(:ids AS uuid[]), CAST(:kinds AS text[]), CAST(:errors AS text[]))
       AS failed (id, kind, error)
 WHERE o.id = ANY(CAST(:ids AS uuid[]))  -- lets the planner use the primary key
   AND o.id = failed.id AND o.status = 'pending'
   AND (CAST(:owner AS text) IS NULL OR o.lease_owner = :owner);

-- name: mark_sent_unleased
-- Exactly-once recovery: rows whose Kafka transaction committed before their owner died.
-- Only the generation the transaction sent: a row requeued by repair since then (a higher
-- generation) was found missing on the topics and must be sent again, not marked sent.
UPDATE {table} AS o
   SET status = 'sent',
       sent_at = coalesce(o.sent_at, now()),
       kafka_partition = acked.kafka_partition,
       kafka_offset = acked.kafka_offset,
       attempts = o.attempts + 1,
       lease_owner = NULL,
       lease_until = NULL
  FROM unnest(CAST(:ids AS uuid[]), CAST(:partitions AS int[]), CAST(:offsets AS bigint[]),
              CAST(:generations AS int[]))
       AS acked (id, kafka_partition, kafka_offset, generation)
 WHERE o.id = ANY(CAST(:ids AS uuid[]))  -- lets the planner use the primary key
   AND o.id = acked.id AND o.status = 'pending' AND o.generation = acked.generation;

-- name: delete_committed
-- Exactly-once recovery in keep-nothing mode: drop rows whose Kafka transaction committed.
DELETE FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'pending';

-- name: break_relay_leases
-- A new shard owner takes back the rows an earlier owner of these shards had leased.
UPDATE {table}
   SET lease_owner = NULL, lease_until = NULL
 WHERE status = 'pending'
   AND shard = ANY(CAST(:shards AS smallint[]))
   AND lease_owner LIKE 'relay-%'
   AND lease_owner <> :owner;

-- name: oldest_pending
-- Age in seconds of the oldest pending row (0 when there is none); one index probe per shard.
SELECT coalesce(extract(epoch FROM now() - min(first.created_at)), 0) AS age
  FROM generate_series(0, :shard_count - 1) AS s (shard)
 CROSS JOIN LATERAL (
       SELECT p.created_at
         FROM {table} AS p
        WHERE p.status = 'pending' AND p.shard = s.shard
        ORDER BY p.seq
        LIMIT 1) AS first;

-- name: list_dead
-- Dead rows, newest first.
SELECT id, topic, key, attempts, error_kind, last_error, created_at
  FROM {table}
 WHERE status = 'dead'
   AND (CAST(:topic AS text) IS NULL OR topic = :topic)
 ORDER BY seq DESC
 LIMIT :limit;

-- name: show_message
-- One row, whole.
SELECT id, seq, shard, topic, key, value, content_type, header_names, header_values,
       idempotency_key, status, attempts, next_attempt_at, lease_owner, lease_until,
       error_kind, last_error, created_at, sent_at, kafka_partition, kafka_offset, generation
  FROM {table}
 WHERE id = :id;

-- name: retry_dead
-- Put dead rows back to pending (all, one topic, or the given ids), with a fresh attempt count.
UPDATE {table}
   SET status = 'pending', attempts = 0, next_attempt_at = NULL, error_kind = NULL,
       last_error = NULL, lease_owner = NULL, lease_until = NULL
 WHERE status = 'dead'
   AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
   AND (CAST(:topic AS text) IS NULL OR topic = :topic);

-- name: purge_dead
-- Delete dead rows (all, one topic, or the given ids).
DELETE FROM {table}
 WHERE status = 'dead'
   AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
   AND (CAST(:topic AS text) IS NULL OR topic = :topic);

-- name: requeue_missing
-- Reconciliation repair: sent rows whose records are on no topic go back to pending, so the
-- relay publishes them again. Rows no longer marked sent are left alone (running it twice
-- changes nothing more). The generation goes up, so that an exactly-once progress record of
-- the earlier send can no longer vouch for the row.
UPDATE {table}
   SET status = 'pending', attempts = 0, next_attempt_at = NULL, error_kind = NULL,
       generation = generation + 1,
       last_error = 'requeued by reconciliation: recorded at ' || topic || '/'
                    || coalesce(kafka_partition::text, '?') || '/'
                    || coalesce(kafka_offset::text, '?') || ', on no topic',
       lease_owner = NULL, lease_until = NULL, sent_at = NULL,
       kafka_partition = NULL, kafka_offset = NULL
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'sent';
