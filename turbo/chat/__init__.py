"""A chat turn: the checkpoint's template rendered in a sandbox (template), one turn prepared and
its answer read for every front -- Runtime.chat, sessions, the server, the terminal chat, the TUI
(turn) -- the answer's reasoning split off (reasoning) and its tool calls read (tool_calls),
sessions that keep their state across turns (session, image_session), and what a chat needs of a
runtime (runtime: the package never imports turbo.engine)."""
