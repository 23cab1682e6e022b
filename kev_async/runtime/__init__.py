"""A small actor runtime on anyio: bounded mailboxes and `ask` (actors), one-for-one supervision
(supervisor), signals, draining and shutdown (lifecycle). Knows nothing of Kev's domain."""
