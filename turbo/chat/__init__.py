"""A chat turn: the checkpoint's template rendered in a sandbox (template), the turn itself for
the library and the server (turn), tool calls read from the answer (tool_calls), sessions that
keep their state across turns (session, image_session) and the terminal chat (cli)."""
