"""What the processes share that is not the wire: the server's configuration (``ServerArgs``,
its flags, Hub-id resolution, parser names), the HTTP API-key check, the chat-template Jinja
environment and the reading of a checkpoint's small JSON files.

The four process packages import this package as they import ``proto/``; it imports no torch
and no process package, so the tokenizer process and the scheduler stay free of both.
"""
