-- ferry_settings: facts fixed by the migrations (lanes, the database id).

-- name: database_id
-- This database's identity (a UUID generated at migration): the scope of
-- default effect keys, `<database_id>:<outbox id>`.
SELECT value FROM ferry_settings WHERE name = 'database_id'
