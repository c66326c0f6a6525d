-- Named queries on the outbox table. Each starts with `-- name: <name>` and a line saying what
-- it does. {table} is the validated, schema-qualified table name; :params are bind parameters.
--
-- Statements that name their rows by id compare the status with (SELECT 'pending') or
-- (SELECT 'prepared'), not with the constant: the planner then cannot take the partial index
-- of that status for them, only the primary key. A partial index still has an entry for every
-- row that left the status since the last vacuum, and statistics taken while few rows had it
-- make it look small: marking 2,000 rows of a 300,000-row backlog walked all of the pending
-- index (190 ms against 12 ms by primary key).

-- name: owner_alive
-- Whether the session that holds the lock (:session_space, :owner_key) is still there: a relay
-- reads and marks on sessions of its own beside the one that holds its shards' locks (its
-- owner session, which takes that lock under a random key when it connects), and touches
-- nothing once that session is gone (and the shards with it, to the next owner). The owner
-- holds the lock exclusively, so a shared try fails while it lives; granted, the try is undone
-- at once. Named by a lock, not a backend pid: a pooler hides the pid, a dead owner's pid can
-- be reused, and a host name may lead another session to another server. Asked by a try-lock,
-- not by reading pg_locks: that view takes every lock-manager partition's lock, holding up every
-- lock taken meanwhile (writers' included), and cost a read 0.1-0.2 ms of its own.
-- The loop itself reads and marks only the shards it holds: it lets a shard go only with no
-- batch of it in flight or being marked.
SELECT CASE WHEN pg_try_advisory_lock_shared(CAST(:session_space AS integer),
                                             CAST(:owner_key AS integer))
            THEN NOT pg_advisory_unlock_shared(CAST(:session_space AS integer),
                                               CAST(:owner_key AS integer))
            ELSE true END;

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
 WHERE id = ANY(CAST(:ids AS uuid[])) AND lease_owner = :owner AND status = (SELECT 'pending')
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
-- sender that leased the rows; the relay passes NULL: it owns the rows' shards, and gives
-- :owner_key, so that nothing is marked once its owner session is gone (see owner_alive).
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
   AND o.id = acked.id AND o.status = (SELECT 'pending') AND o.generation = acked.generation
   AND (CAST(:owner AS text) IS NULL OR o.lease_owner = :owner)
   AND (CAST(:owner_key AS integer) IS NULL OR ({owner_alive}));

-- name: delete_sent
-- Keep-nothing retention: drop pending rows once Kafka acknowledged them (:owner and
-- :owner_key as in mark_sent).
DELETE FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = (SELECT 'pending')
   AND (CAST(:owner AS text) IS NULL OR lease_owner = :owner)
   AND (CAST(:owner_key AS integer) IS NULL OR ({owner_alive}));

-- name: purge_sent
-- Delete one batch of rows that are done, from before the cutoff: sent rows created and sent
-- before it, and prepared messages rolled back or scheduled ones cancelled before it (never
-- published). Prepared and scheduled rows are never deleted. The UUIDv7 id bounds the creation time, so the primary key index finds them.
WITH doomed AS (
    SELECT id
      FROM {table}
     WHERE id < :cutoff_id
       AND ((status = 'sent' AND sent_at < :cutoff)
            OR (status IN ('rolled_back', 'cancelled') AND resolved_at < :cutoff))
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
-- Each shard's window is its first :window rows that may go. Rows that may not are passed over
-- before they are counted, each by one probe of a small partial index, and only in a shard
-- that has such rows: rows backing off and the later rows of their keys (the retry index),
-- rows leased by an immediate sender and the later rows of their keys (the lease index, up to
-- :held_reach of them per shard). So a key with a deep backlog behind a failing or leased
-- message never fills the window by itself.
-- Given :owner_key, nothing is read once its owner session is gone (see owner_alive).
WITH held AS MATERIALIZED (
    SELECT s.shard
      FROM unnest(CAST(:shards AS smallint[])) AS s (shard)
     WHERE CAST(:owner_key AS integer) IS NULL OR ({owner_alive})),
window_rows AS (
    SELECT p.*
      FROM held AS s
     CROSS JOIN LATERAL (
           SELECT EXISTS (
                  SELECT 1 FROM {table} AS f
                   WHERE f.status = 'pending' AND f.next_attempt_at > now()
                     AND f.shard = s.shard) AS backing_off,
                  EXISTS (
                  SELECT 1 FROM {table} AS l
                   WHERE l.status = 'pending' AND l.lease_until IS NOT NULL
                     AND l.lease_until > now() AND l.shard = s.shard) AS leasing) AS r
     CROSS JOIN LATERAL (
           SELECT w.*
             FROM (SELECT p.id, p.seq, p.shard, p.topic, p.key, p.value, p.content_type,
                          p.header_names, p.header_values, p.attempts, p.created_at,
                          p.generation, p.lease_until
                     FROM {table} AS p
                    WHERE p.status = 'pending' AND p.shard = s.shard
                      AND (p.next_attempt_at IS NULL OR p.next_attempt_at <= now())
                      -- Probed only in a shard with rows backing off, and kept a probe per
                      -- row by the OR (an anti join would compare each row with every such
                      -- row).
                      AND (NOT r.backing_off OR p.key IS NULL OR NOT EXISTS (
                          SELECT 1
                            FROM {table} AS f
                           WHERE f.status = 'pending' AND f.next_attempt_at > now()
                             AND f.shard = p.shard AND f.topic = p.topic
                             AND f.key = p.key AND f.seq < p.seq))
                    ORDER BY p.seq
                    -- The walk's bound: leased rows and their keys' later rows passed over
                    -- count towards it.
                    LIMIT CAST(:window AS integer) + CAST(:held_reach AS integer)) AS w
            WHERE (w.lease_until IS NULL OR w.lease_until <= now())
              AND (NOT r.leasing OR w.key IS NULL OR NOT EXISTS (
                  SELECT 1
                    FROM {table} AS l
                   WHERE l.status = 'pending' AND l.lease_until IS NOT NULL
                     AND l.lease_until > now()
                     AND l.shard = w.shard AND l.topic = w.topic
                     AND l.key = w.key AND l.seq < w.seq))
            ORDER BY w.seq
            LIMIT :window) AS p)
-- (Columns in the order of outbox.rows.READ_COLUMNS; the id also as text, for its header.)
SELECT w.id, w.seq, w.shard, w.topic, w.key, w.value, w.content_type, w.header_names,
       w.header_values, w.attempts, w.created_at, w.generation, CAST(w.id AS text) AS id_text
  FROM window_rows AS w
 ORDER BY w.seq
 LIMIT :batch_size;

-- name: leases_held
-- Whether an immediate sender holds, or held, pending rows of the given shards (the lease
-- index): their keys' later rows wait for the sender's mark, an UPDATE that wakes no relay.
-- A lease that ran out counts too, until its row is marked or given back: it may have run
-- out after the read that found its key held, and no commit wakes the relay for that.
SELECT EXISTS (
       SELECT 1 FROM {table}
        WHERE status = 'pending' AND lease_until IS NOT NULL
          AND shard = ANY(CAST(:shards AS smallint[])));

-- name: mark_retry
-- Record a failed attempt: back off until next_attempt_at, keep the error, give the row back
-- (:owner and :owner_key as in mark_sent).
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
   AND o.id = failed.id AND o.status = (SELECT 'pending')
   AND (CAST(:owner AS text) IS NULL OR o.lease_owner = :owner)
   AND (CAST(:owner_key AS integer) IS NULL OR ({owner_alive}));

-- name: mark_dead
-- Give up on rows: they stay, dead, with the reason, until an operator retries or purges them
-- (:owner and :owner_key as in mark_sent).
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
   AND o.id = failed.id AND o.status = (SELECT 'pending')
   AND (CAST(:owner AS text) IS NULL OR o.lease_owner = :owner)
   AND (CAST(:owner_key AS integer) IS NULL OR ({owner_alive}));

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
   AND o.id = acked.id AND o.status = (SELECT 'pending') AND o.generation = acked.generation;

-- name: delete_committed
-- Exactly-once recovery in keep-nothing mode: drop rows whose Kafka transaction committed.
DELETE FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = (SELECT 'pending');

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
       error_kind, last_error, created_at, sent_at, kafka_partition, kafka_offset, generation,
       prepared_at, check_group, check_count, next_check_at, last_checked_at,
       last_check_answer, last_check_error, resolved_at, resolved_by, deliver_at
  FROM {table}
 WHERE id = :id;

-- name: retry_dead
-- Put dead rows back to pending (all, one topic, or the given ids), with a fresh attempt count.
-- Prepared messages that check-back left dead ('unresolved') are not among them: nobody knows
-- whether their business step happened; `outbox prepared commit/rollback` decides them.
UPDATE {table}
   SET status = 'pending', attempts = 0, next_attempt_at = NULL, error_kind = NULL,
       last_error = NULL, lease_owner = NULL, lease_until = NULL
 WHERE status = 'dead' AND error_kind IS DISTINCT FROM 'unresolved'
   AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
   AND (CAST(:topic AS text) IS NULL OR topic = :topic);

-- name: dead_errors
-- Every dead row's error, to group them by cause (outbox.fingerprints), optionally one
-- topic's. Rows check-back left dead ('unresolved') are listed too; retry_dead skips them.
SELECT id, topic, error_kind, last_error, created_at
  FROM {table}
 WHERE status = 'dead'
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

-- Prepared messages (docs/prepared-messages.md). A prepared row has status 'prepared': the
-- relay and the immediate sender read only pending rows, so it is invisible to them and holds
-- back nothing. Check-back runners find the rows due a check through <table>_prepared_idx.
-- A message that check-back gave up on and left dead for an operator has error_kind
-- 'unresolved'; it may still be committed or rolled back.

-- name: insert_prepared
-- Prepare one message, due its first check :check_after seconds from now by the checker
-- registered as :check_group, to be delivered not before :deliver_at (NULL: when committed).
-- An idempotency key already stored writes nothing (no row back).
INSERT INTO {table} (id, shard, topic, key, value, content_type, header_names, header_values,
                     idempotency_key, status, prepared_at, check_group, next_check_at,
                     deliver_at)
VALUES (:id, :shard, :topic, :key, :value, :content_type, CAST(:header_names AS text[]),
        CAST(:header_values AS bytea[]), :idempotency_key, 'prepared', now(), :check_group,
        now() + make_interval(secs => :check_after), CAST(:deliver_at AS timestamptz))
ON CONFLICT DO NOTHING
RETURNING id;

-- name: find_idempotency_key
-- The message already stored under an idempotency key.
SELECT id FROM {table} WHERE idempotency_key = :key;

-- name: commit_prepared
-- Commit one prepared message (run once per id, in the order to keep): it becomes pending and
-- takes a new seq, so it joins its key's order now, behind every message of the key committed
-- before it, as a half message becomes visible when it is committed. created_at becomes the
-- commit's time (prepared_at keeps the prepare's); :by says who decided. One prepared with a
-- deliver_at still ahead becomes scheduled instead: its place is taken when it is due.
UPDATE {table}
   SET status = CASE WHEN deliver_at > now() THEN 'scheduled' ELSE 'pending' END,
       seq = DEFAULT, created_at = now(), resolved_at = now(),
       resolved_by = :by, next_check_at = NULL, lease_owner = NULL, lease_until = NULL,
       attempts = 0, next_attempt_at = NULL, error_kind = NULL, last_error = NULL
 WHERE id = :id
   AND (status = 'prepared' OR (status = 'dead' AND error_kind = 'unresolved'));

-- name: commit_rolled_back
-- Commit a message that check-back or an operator rolled back (never one its producer did):
-- the step happened after all. As commit_prepared, and it takes back the idempotency key it
-- gave up at the rollback; one whose key another message took since (a retry, which stands
-- for the same event) is left rolled back. Messages rolled back before revision 0011 kept no
-- key: nothing tells.
UPDATE {table} AS o
   SET status = CASE WHEN o.deliver_at > now() THEN 'scheduled' ELSE 'pending' END,
       seq = DEFAULT, created_at = now(), resolved_at = now(),
       resolved_by = :by, next_check_at = NULL, lease_owner = NULL, lease_until = NULL,
       attempts = 0, next_attempt_at = NULL, error_kind = NULL, last_error = NULL,
       idempotency_key = o.released_idempotency_key, released_idempotency_key = NULL
 WHERE o.id = :id AND o.status = 'rolled_back'
   AND o.resolved_by IN ('check', 'expired', 'operator')
   AND (o.released_idempotency_key IS NULL
        OR NOT EXISTS (SELECT 1 FROM {table} AS taken
                        WHERE taken.idempotency_key = o.released_idempotency_key));

-- name: rollback_prepared
-- Roll prepared messages back, for good: they are never published. :by says who decided.
-- The idempotency key is given up: a rolled-back message stands for a step that did not
-- happen, so a later message with the same key (a retry) must not be taken for its duplicate.
-- released_idempotency_key keeps it, for a commit after the rollback. One check-back left dead
-- loses its 'unresolved' error_kind: it is decided now.
UPDATE {table}
   SET status = 'rolled_back', resolved_at = now(), resolved_by = :by, next_check_at = NULL,
       lease_owner = NULL, lease_until = NULL, error_kind = NULL,
       released_idempotency_key = idempotency_key, idempotency_key = NULL
 WHERE id = ANY(CAST(:ids AS uuid[]))
   AND (status = 'prepared' OR (status = 'dead' AND error_kind = 'unresolved'));

-- name: rollback_checked
-- An operator's rollback of messages whose checker, asked just now, answered ROLLBACK (it
-- made sure the step can no longer happen): as rollback_prepared, and that check is recorded
-- (count, time, answer), so the row shows its step was blocked before the rollback.
UPDATE {table}
   SET status = 'rolled_back', resolved_at = now(), resolved_by = :by, next_check_at = NULL,
       lease_owner = NULL, lease_until = NULL, error_kind = NULL,
       released_idempotency_key = idempotency_key, idempotency_key = NULL,
       check_count = check_count + 1, last_checked_at = now(),
       last_check_answer = 'rollback', last_check_error = NULL
 WHERE id = ANY(CAST(:ids AS uuid[]))
   AND (status = 'prepared' OR (status = 'dead' AND error_kind = 'unresolved'));

-- name: wake_relays
-- What the table's insert trigger does (revision 0003), for a statement that makes rows
-- pending without inserting them: hold the wake lock shared until commit, and have the commit
-- notify when a sleeping relay holds the lock.
SELECT pg_notify(:channel, '')
 WHERE NOT pg_try_advisory_xact_lock_shared(:wake_space, :wake_number);

-- name: prepared_statuses
-- Where the given messages stand (to explain a commit or rollback that changed nothing).
SELECT id, status, error_kind, prepared_at, resolved_by
  FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[]));

-- name: rolled_back_statuses
-- prepared_statuses, and for a commit after a rollback that changed nothing: the idempotency
-- key the rollback gave up, and the message that holds it now (a retry), if any.
SELECT o.id, o.status, o.error_kind, o.prepared_at, o.resolved_by,
       o.released_idempotency_key,
       (SELECT taken.id FROM {table} AS taken
         WHERE taken.idempotency_key = o.released_idempotency_key LIMIT 1) AS key_holder
  FROM {table} AS o
 WHERE o.id = ANY(CAST(:ids AS uuid[]));

-- name: claim_due_checks
-- Check-back: take up to :limit prepared rows of the checkers :groups whose check is due,
-- longest due first, leased to this runner (:owner) for :lease_seconds so that other runners
-- leave them alone while they are checked. Rows another runner is claiming are skipped.
WITH due AS (
    SELECT id
      FROM {table}
     WHERE status = 'prepared' AND next_check_at <= now()
       AND check_group = ANY(CAST(:groups AS text[]))
       AND (lease_until IS NULL OR lease_until <= now())
     ORDER BY next_check_at
     LIMIT :limit
       FOR UPDATE SKIP LOCKED)
UPDATE {table} AS o
   SET lease_owner = :owner, lease_until = now() + make_interval(secs => :lease_seconds)
  FROM due
 WHERE o.id = due.id
RETURNING o.id, o.topic, o.key, o.value, o.content_type, o.header_names, o.header_values,
          o.check_group, o.check_count, o.prepared_at,
          extract(epoch FROM now() - o.prepared_at) AS age_seconds;

-- name: record_checks
-- Check-back: record one check of each row this runner (:owner) still holds: the count, the
-- time, the answer (commit, rollback, unknown, error, timeout) with its error, and when to
-- check again (:delays seconds from now). An error or a timeout also counts as a failed
-- check (check_failures). The lease is given back. Returns the rows recorded, still
-- prepared, with their new count; the caller then acts on the answers in the same
-- transaction.
UPDATE {table} AS o
   SET check_count = o.check_count + 1,
       check_failures = o.check_failures
                        + CASE WHEN c.answer IN ('error', 'timeout') THEN 1 ELSE 0 END,
       last_checked_at = now(),
       last_check_answer = c.answer,
       last_check_error = c.error,
       next_check_at = now() + make_interval(secs => c.delay),
       lease_owner = NULL,
       lease_until = NULL
  FROM unnest(CAST(:ids AS uuid[]), CAST(:answers AS text[]), CAST(:errors AS text[]),
              CAST(:delays AS float8[])) AS c (id, answer, error, delay)
 WHERE o.id = ANY(CAST(:ids AS uuid[]))  -- lets the planner use the primary key
   AND o.id = c.id AND o.status = (SELECT 'prepared') AND o.lease_owner = :owner
RETURNING o.id, o.check_count;

-- name: expire_prepared
-- Check-back gives up on prepared rows that had :max_checks checks without a verdict: they
-- end dead for an operator (error_kind 'unresolved'), who may still commit or roll them back.
-- Nothing ends rolled back here: with --on-max-checks rollback the last check was asked to
-- decide, and only its ROLLBACK (the step blocked) rolled a message back, before this.
-- Returns the rows it ended and how.
UPDATE {table}
   SET status = 'dead',
       next_check_at = NULL,
       error_kind = 'unresolved',
       last_error = 'no verdict after ' || check_count || ' checks ('
                    || check_failures || ' failed; last answer: '
                    || coalesce(last_check_answer, '-') || ')'
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = (SELECT 'prepared')
   AND check_count >= :max_checks
RETURNING id, status;

-- name: checkback_access
-- What a check-back runner needs of the table :name: that it exists, has the columns of
-- revision 0004 (prepared), 0007 (upgraded) and 0011 (keeps_released_keys), and that the
-- role may SELECT and UPDATE it (one privilege per call: given a list, PostgreSQL answers
-- true when any one is held).
SELECT t.oid IS NOT NULL AS table_exists,
       EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = t.oid AND attname = 'check_group' AND NOT attisdropped)
           AS prepared,
       EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = t.oid AND attname = 'check_failures' AND NOT attisdropped)
           AS upgraded,
       EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = t.oid AND attname = 'released_idempotency_key'
                  AND NOT attisdropped)
           AS keeps_released_keys,
       t.oid IS NOT NULL AND has_table_privilege(t.oid, 'SELECT')
           AND has_table_privilege(t.oid, 'UPDATE') AS allowed,
       current_user AS role
  FROM (SELECT to_regclass(:name) AS oid) AS t;

-- name: count_prepared
-- Prepared messages of the checkers :groups: how many, and the age in seconds of the oldest.
SELECT check_group, count(*) AS prepared,
       extract(epoch FROM now() - min(prepared_at)) AS oldest
  FROM {table}
 WHERE status = 'prepared' AND check_group = ANY(CAST(:groups AS text[]))
 GROUP BY check_group;

-- name: select_unresolved
-- Messages waiting for a verdict (prepared, or left dead by check-back), oldest first: the
-- given ids, one topic's, one check group's, or all, up to :limit. With what a checker gets
-- of them (an operator's rollback asks it).
SELECT id, topic, key, check_group, status, prepared_at, check_count, check_failures,
       last_checked_at, last_check_answer, next_check_at, value, content_type,
       header_names, header_values, extract(epoch FROM now() - prepared_at) AS age_seconds
  FROM {table}
 WHERE (status = 'prepared' OR (status = 'dead' AND error_kind = 'unresolved'))
   AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
   AND (CAST(:topic AS text) IS NULL OR topic = :topic)
   AND (CAST(:check_group AS text) IS NULL OR check_group = :check_group)
 ORDER BY prepared_at, id
 LIMIT :limit;

-- name: select_unblocked_rollbacks
-- Rolled-back messages whose step nothing blocked before the rollback, so it may have
-- happened: check-back gave up on them at max checks after UNKNOWN answers (as it did before
-- it asked the last check to decide), or an operator rolled them back without a check
-- (--step-cannot-happen). A checker's ROLLBACK, which blocks the step, is recorded as the last
-- answer; a producer's rollback says the step did not happen. Newest first, up to :limit.
-- Reads every row (no index holds rolled-back ones): an operator's look, not a loop's.
SELECT id, topic, key, check_group, status, prepared_at, resolved_at, resolved_by,
       check_count, check_failures, last_check_answer
  FROM {table}
 WHERE status = 'rolled_back' AND resolved_by IN ('expired', 'operator')
   AND last_check_answer IS DISTINCT FROM 'rollback'
   AND (CAST(:topic AS text) IS NULL OR topic = :topic)
   AND (CAST(:check_group AS text) IS NULL OR check_group = :check_group)
 ORDER BY resolved_at DESC, id
 LIMIT :limit;

-- Scheduled messages (docs/scheduled.md). A scheduled row has status 'scheduled' and a
-- deliver_at: the relay's read and the immediate sender take only pending rows, so it is
-- invisible to them and holds back nothing, however many wait. The relay that owns its shard
-- makes it pending once it is due (due_scheduled, then promote_scheduled), through
-- <table>_scheduled_idx (shard, deliver_at, seq), which holds the scheduled rows only.

-- name: due_scheduled
-- The relay's look at the scheduled rows of its shards: the due ones (up to :limit, with
-- deliver_at and seq: they are made pending in that order; topic and key: a key stops at its
-- first row another transaction holds locked), and in a row of their own (id
-- NULL) the seconds until the next one is due. Two probes of the scheduled index per shard
-- (its due end, and the first entry past now), whatever lies further ahead. Given
-- :owner_key, nothing is read once its owner session is gone (see owner_alive).
WITH held AS MATERIALIZED (
    SELECT s.shard
      FROM unnest(CAST(:shards AS smallint[])) AS s (shard)
     WHERE CAST(:owner_key AS integer) IS NULL OR ({owner_alive})),
due AS (
    SELECT d.id, d.deliver_at, d.seq, d.topic, d.key
      FROM held AS h
     CROSS JOIN LATERAL (
           SELECT id, deliver_at, seq, topic, key
             FROM {table}
            WHERE status = 'scheduled' AND shard = h.shard AND deliver_at <= now()
            ORDER BY deliver_at, seq
            LIMIT :limit) AS d
     ORDER BY d.deliver_at, d.seq
     LIMIT :limit),
ahead AS (
    SELECT min(n.deliver_at) AS deliver_at
      FROM held AS h
     CROSS JOIN LATERAL (
           SELECT deliver_at
             FROM {table}
            WHERE status = 'scheduled' AND shard = h.shard AND deliver_at > now()
            ORDER BY deliver_at
            LIMIT 1) AS n)
SELECT id, deliver_at, seq, topic, key, CAST(NULL AS float8) AS wait FROM due
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, CAST(extract(epoch FROM deliver_at - now()) AS float8)
  FROM ahead
 WHERE deliver_at IS NOT NULL;

-- name: lock_due_scheduled
-- Of the due rows the promotion is about to make pending (:ids), lock those no other
-- transaction holds (a cancel in progress, say), waiting for none, with their status (one
-- cancelled meanwhile is no longer scheduled); the rows held are skipped, and their keys'
-- later rows with them, until the next look.
SELECT id, status
  FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[]))
   FOR UPDATE SKIP LOCKED;

-- name: promote_scheduled
-- Make one due scheduled row pending (run once per id, in one transaction, in the order
-- due_scheduled gives: deliver_at, then seq): it takes a new seq, so it joins its key's order
-- now, behind every message of the key made pending before it, as a committed prepared
-- message does (commit_prepared); created_at becomes the time it fell in line. A row
-- cancelled meanwhile is left alone, and so is one locked by a cancel still in progress (a
-- service may cancel inside a long business transaction): the relay does not wait for it,
-- it looks again at its next promotion.
UPDATE {table}
   SET status = 'pending', seq = DEFAULT, created_at = now(), lease_owner = NULL,
       lease_until = NULL
 WHERE id = (SELECT id
               FROM {table}
              WHERE id = :id AND status = (SELECT 'scheduled')
                FOR UPDATE SKIP LOCKED);

-- name: count_scheduled
-- For the relay's gauge: scheduled rows, a count of the whole scheduled index (128 ms for a
-- million on a shared two-core machine: the relay counts them once a minute).
SELECT count(*) FROM {table} WHERE status = 'scheduled';

-- name: count_overdue
-- For the relay's gauge: scheduled rows due more than a second ago (no relay made them
-- pending); one range of the scheduled index per shard, however many lie ahead.
SELECT count(*)
  FROM generate_series(0, :shard_count - 1) AS s (shard)
 CROSS JOIN LATERAL (
       SELECT 1
         FROM {table}
        WHERE status = 'scheduled' AND shard = s.shard
          AND deliver_at < now() - interval '1 second') AS overdue;

-- name: cancel_scheduled
-- Cancel scheduled messages (the given ids): they are never sent. Only rows still scheduled
-- (a row the relay made pending may be on its topic already). :by says who cancelled. The
-- idempotency key is given up, as a rollback does: a message published again with it is a
-- new one, not a duplicate of the cancelled one.
UPDATE {table}
   SET status = 'cancelled', resolved_at = now(), resolved_by = :by, idempotency_key = NULL
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = (SELECT 'scheduled')
RETURNING id;

-- name: list_scheduled
-- Scheduled messages, the soonest due first: the given ids, one topic's, or all, up to :limit.
SELECT id, topic, key, deliver_at, created_at, idempotency_key,
       extract(epoch FROM deliver_at - now()) AS due_in
  FROM {table}
 WHERE status = 'scheduled'
   AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
   AND (CAST(:topic AS text) IS NULL OR topic = :topic)
 ORDER BY deliver_at, seq
 LIMIT :limit;

-- Operators' view (`outbox status`, outbox/status.py). Each of these reads little however many
-- sent rows the table holds: pending and prepared rows through their partial indexes, the
-- other statuses from the planner's statistics (status_by_topic, one scan, only on request).
-- docs/operations.md shows their plans on a table of a million sent rows.

-- name: status_pending
-- Pending rows per topic (through the pending index): how many, how many are backing off
-- before a retry, and the age in seconds of the oldest.
SELECT topic, count(*) AS pending,
       count(*) FILTER (WHERE next_attempt_at > now()) AS backing_off,
       extract(epoch FROM now() - min(created_at)) AS oldest
  FROM {table}
 WHERE status = 'pending'
 GROUP BY topic;

-- name: status_prepared
-- Prepared messages waiting for a verdict, per topic and checker (through the prepared
-- index): how many, and the age in seconds of the oldest.
SELECT topic, check_group, count(*) AS prepared,
       extract(epoch FROM now() - min(prepared_at)) AS oldest
  FROM {table}
 WHERE status = 'prepared'
 GROUP BY topic, check_group;

-- name: status_scheduled
-- Scheduled messages per topic (through the scheduled index): how many, how many are overdue
-- (due more than a second ago and still scheduled), and the seconds until the next is due
-- (below zero: overdue).
SELECT topic, count(*) AS scheduled,
       count(*) FILTER (WHERE deliver_at < now() - interval '1 second') AS overdue,
       extract(epoch FROM min(deliver_at) - now()) AS next_due
  FROM {table}
 WHERE status = 'scheduled'
 GROUP BY topic;

-- name: status_estimates
-- Rows per status as the planner estimates them, without reading the table: the table's size
-- now (its pages, times the rows per page of the last ANALYZE or VACUUM) times each status's
-- share in ANALYZE's sample. No rows before the table was first analyzed; a status too rare
-- to be in the sample (a few dead rows among millions) is missing. A partitioned table sums
-- its partitions' estimates (autovacuum analyzes partitions, never their parent).
SELECT v.status,
       round(sum(c.reltuples / c.relpages
                 * (pg_relation_size(c.oid) / current_setting('block_size')::integer)
                 * v.share)) AS estimate
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 CROSS JOIN LATERAL (
       SELECT unnest(CAST(CAST(s.most_common_vals AS text) AS text[])) AS status,
              unnest(s.most_common_freqs) AS share
         FROM pg_stats AS s
        WHERE s.schemaname = n.nspname AND s.tablename = c.relname AND NOT s.inherited
          AND s.attname = 'status') AS v
 WHERE c.oid IN (SELECT to_regclass(:qualified_name)
                  UNION ALL
                 SELECT relid FROM pg_partition_tree(to_regclass(:qualified_name)))
   AND c.relkind = 'r' AND c.reltuples >= 0 AND c.relpages > 0
 GROUP BY v.status;

-- name: status_by_topic
-- Exact counts per topic and status: one scan of the whole table (`outbox status --exact`).
SELECT topic, status, count(*) AS n
  FROM {table}
 GROUP BY topic, status;

-- name: status_relays
-- The relays connected to this table, from the advisory locks they hold on their owner
-- session (outbox/relay/leases.py): its session lock (:session_space, one per relay), its
-- member lock (:member_space, while it takes part in sharing the shards), its serving lock
-- (:serving_space, while Kafka takes its work, see outbox/relay/reach.py) and one lock per
-- shard it owns (:shard_space, the shard number). Reading pg_locks briefly takes every
-- lock-manager partition's lock: fine for an operator's command, not for a loop.
SELECT l.pid, a.application_name, host(a.client_addr) AS client_addr,
       a.backend_start, CAST(l.classid AS bigint) AS space, CAST(l.objid AS bigint) AS number
  FROM pg_locks AS l
  LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.mode = 'ExclusiveLock'
   AND CAST(l.classid AS bigint) IN (:session_space, :member_space, :serving_space,
                                     :shard_space)
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY a.backend_start, l.pid;

-- name: sent_recently
-- Messages sent since :since per topic, among those whose id is :since_id or later (the
-- dashboard's "sent in the last hour"): a range of the primary key, as UUIDv7 ids are
-- time-ordered, not a scan of every sent row. A message published before :since_id's time
-- and sent since (one that waited in a backlog, a prepared or scheduled one) is not counted.
SELECT topic, count(*) AS sent
  FROM {table}
 WHERE id >= CAST(:since_id AS uuid) AND status = 'sent' AND sent_at >= :since
 GROUP BY topic;

-- name: dead_details
-- What the dashboard shows of each dead message it lists (the ids of one cause's first
-- rows), through the primary key.
SELECT id, topic, key, attempts, error_kind, last_error, created_at
  FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'dead';

-- name: topics_in_use
-- The topics `outbox topics check` must find: those of rows still to be sent (pending, through
-- the pending index; prepared and scheduled, through theirs) and of the latest :recent rows
-- written (a backward walk of the primary key: UUIDv7 ids sort by creation time).
SELECT topic FROM {table} WHERE status = 'pending'
UNION
SELECT topic FROM {table} WHERE status = 'prepared'
UNION
SELECT topic FROM {table} WHERE status = 'scheduled'
UNION
SELECT topic FROM (SELECT topic FROM {table} ORDER BY id DESC LIMIT :recent) AS latest;

-- name: wal_aside
-- WAL mode: the rows waiting aside after a failed attempt (the retry index), in seq order, with
-- the seconds until they are due: the WAL source reads them when it starts, since the slot
-- may have moved past them. (Columns of outbox.rows.READ_COLUMNS, then the delay.)
SELECT id, seq, shard, topic, key, value, content_type, header_names, header_values, attempts,
       created_at, generation, CAST(id AS text),
       GREATEST(0, EXTRACT(EPOCH FROM next_attempt_at - now()))
  FROM {table}
 WHERE status = 'pending' AND next_attempt_at IS NOT NULL
 ORDER BY seq;

-- name: wal_replayed
-- WAL mode: of the rows a restarted stream hands out again (:ids), those that may go as new:
-- still pending and not waiting aside (a row dead, sent, aside or purged has its outcome).
SELECT id FROM {table}
 WHERE id = ANY(CAST(:ids AS uuid[])) AND status = (SELECT 'pending')
   AND next_attempt_at IS NULL;

-- name: wal_horizon
-- WAL mode: a WAL position and the oldest transaction still running in a snapshot taken
-- before it (the statement's, taken when it starts): every transaction that commits after
-- the position is at least as new as that one.
SELECT CAST(pg_current_wal_insert_lsn() - CAST('0/0' AS pg_lsn) AS bigint),
       CAST(CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS bigint);

-- name: wal_unsettled
-- WAL mode, after a lost slot: the pending rows written, or last changed, by transactions no
-- older than :horizon (a 64-bit transaction id; age() compares the 32-bit ids of the rows).
-- A horizon :reach or more transactions back, or none, takes every pending row.
-- (Columns of outbox.rows.READ_COLUMNS.)
SELECT id, seq, shard, topic, key, value, content_type, header_names, header_values, attempts,
       created_at, generation, CAST(id AS text)
  FROM {table}
 WHERE status = 'pending'
   AND (CAST(:horizon AS bigint) IS NULL
        OR CAST(CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS bigint)
           - CAST(:horizon AS bigint) >= CAST(:reach AS bigint)
        OR age(xmin) <= age(CAST(CAST(CAST(:horizon AS bigint) % 4294967296 AS text) AS xid)))
 ORDER BY shard, seq;
