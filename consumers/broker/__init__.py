"""The embedded broker (Tansu as a child process) and the local object store its durable mode keeps data in."""
