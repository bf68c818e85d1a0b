"""One serving engine: a runtime, its scheduler and what the routes need around them (the chat
template, the turn's stop ids, the model's name, the metrics), and the step from a checked body
(protocol.Body) to the scheduler's Request. A local server has one; each Ray replica its own."""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from pathlib import Path

from ..bounded import read_small_text
from ..chat.template import ChatTemplate, install_template
from ..chat.turn import Turn, check_template_kwargs, turn_stop_ids
from ..engine import open as open_runtime
from ..errors import TurboError
from ..sequence.options import ContextTooLong, GenerationOptions, OpenOptions
from ..sequence.state_files import StateDir, stamp_of
from ..vision.positions import expanded_row
from .body import check_text_lengths
from .images import expand_images, image_rows
from .limits import check_prompt_chars, check_prompt_tokens, context_error, max_token_chars
from .metrics import Metrics
from .protocol import ApiError, Body, param_of, request_error  # (param_of: app.py's too)
from .scheduler import Overloaded, Request, Scheduler
from .settings import ServeConfig


@dataclass
class Prepared:
    request: Request
    turn: Turn | None = None  # chat: the turn, whose answer the app reads (turbo/chat/turn.py)
    prompt_param: str = "prompt"  # prompt | messages: where the prompt is, as a context refusal names it
    sized: bool = True  # the request gave max_tokens (else it is the room the prompt leaves)

    @property
    def forced(self) -> bool:
        """tool_choice required or named: the response_format is the tools' call grammar."""
        return self.turn is not None and self.turn.forced is not None


class Engine:
    """`Engine(install, opening, defaults, config)`: opens the runtime (minutes for a large
    install); `start()` starts the scheduler's thread."""

    def __init__(self, install: str, opening: OpenOptions, defaults: GenerationOptions, config: ServeConfig):
        self.rt = rt = open_runtime(install, opening)
        self.config, self.defaults = config, defaults
        self.model = config.model_name or rt.install.path.name
        self.max_positions = rt.install.arch.max_positions
        self.max_prompt_chars = self.max_positions * max_token_chars(rt.tokenizer)  # (limits.py: before tokenizing)
        if config.chat_template is not None:
            path = Path(config.chat_template).expanduser()
            source = read_small_text(path, f"serve.chat_template={path}", "chat_template")  # (/dev/zero: refused)
            self.template: ChatTemplate | None = ChatTemplate(source, str(path), rt.install.template_files.special_tokens)
            self.template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)  # refused now
        else:
            self.template = install_template(rt.install) if rt.install.template_files.source is not None else None
        self.stop_ids = turn_stop_ids(rt.install, rt.tokenizer)
        self.scheduler = Scheduler(rt, config.limits)
        self.states = self._state_dir(config)
        self.metrics = Metrics(self.model, self.scheduler.gauges)
        gc.freeze()  # (as the CLI: what lives as long as the process leaves the collector's walks)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        if self.states is not None:
            self.states.close()  # (what is queued is written before the process ends)

    def _state_dir(self, config: ServeConfig) -> StateDir | None:
        """serve.state_dir: the prefix cache filled from its files (a file that does not match is
        one warning line and removed: the server starts anyway), then every state the cache keeps
        written there too (turbo/sequence/state_files.py)."""
        if config.state_dir is None:
            return None
        rt, cache = self.rt, self.scheduler.cache
        states = StateDir(Path(config.state_dir).expanduser(), int(config.state_gb * 2**30),
                          stamp_of(rt.install, rt.trunk, rt.options), rt.trunk.device,
                          lambda line: print(f"warning: serve.state_dir: {line}", file=sys.stderr, flush=True))
        states.load_into(cache)
        cache.on_keep = states.kept
        return states

    def piece(self, token: int) -> str:
        return self.rt.tokenizer.decode([token], skip_special_tokens=False)

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise ApiError(f"The model `{name}` does not exist (this server serves `{self.model}`).", "model",
                           404, code="model_not_found")

    def check_chars(self, body: Body) -> None:
        """A 400 for a prompt, or one message's text, longer than any prompt the context could hold:
        checked on the body as parsed (lengths only), before a thread, the template or the
        tokenizer spends anything on it. (prepare checks the rendered prompt again.)"""
        check_text_lengths(body.prompt, body.messages, body.chat, self.max_prompt_chars, self.max_positions)

    def prepare(self, body: Body) -> Prepared:
        """The body as the scheduler's Request: the prompt's ids (a chat's turn rendered by the
        template), the options over the server's defaults, the length checked against the context."""
        self.check_model(body.model)
        turn, images, marks = None, [], {}
        if body.chat:
            turn = self._turn(body)
            prompt = turn.prompt
            check_prompt_chars(prompt, self.max_prompt_chars, self.max_positions, "messages")
            check_prompt_tokens(self.rt.tokenizer, prompt, self.max_positions, "messages")
            ids = self._ids(lambda: turn.ids(self.rt.tokenizer), "messages")
            # where the prefix cache keeps the state on the way (no cache: no render spent on them):
            # before each shared part's last token (a kept state's key is the rows it holds and the
            # anchor after them: the part's last token)
            parts = turn.boundaries(self.rt.tokenizer, ids, body.template_kwargs) if self.scheduler.keeps_prefixes \
                else {}
            unexpanded = ids
            ids, images = expand_images(self.rt, body.messages, ids, self.config.image_dirs,
                                        self.config.remote_images)  # (turbo/serve/images.py)
            if images:  # the parts counted in expanded rows: each image before a part adds its rows
                counts, image_id = image_rows(self.rt, images)
                parts = {expanded_row(unexpanded, counts, image_id, n): kind for n, kind in parts.items()}
            marks = {n - 1: kind for n, kind in parts.items()}
        else:
            if isinstance(body.prompt, str):
                check_prompt_chars(body.prompt, self.max_prompt_chars, self.max_positions, "prompt")
                check_prompt_tokens(self.rt.tokenizer, body.prompt, self.max_positions, "prompt")
            ids = self._ids(lambda: self.rt.encode(body.prompt), "prompt")
        # OpenAI's default max_tokens: the room the prompt leaves (at least 1: a prompt that fills the
        # context is the context check's to refuse, when the scheduler prepares it: options.fit_context)
        wanted = body.max_tokens if body.max_tokens is not None else max(self.max_positions - len(ids), 1)
        fields = {"max_new_tokens": wanted, **body.options}  # (the speculation's: turbo/sequence/policy.py decides)
        try:  # a chat's: the turn's stop tokens and the call its tool_choice forces (turbo/chat/turn.py)
            options = (turn.options_of(None, fields, self.defaults) if turn is not None
                       else self.defaults.but(**fields))
        except TurboError as e:
            raise request_error(e, param_of(e, body.max_tokens_param, turn is not None and turn.forced is not None)) \
                from None
        return Prepared(Request(ids, options, body.logprobs, images or None, marks), turn,
                        "messages" if body.chat else "prompt", body.max_tokens is not None)

    def submit(self, prepared: Prepared, sink, max_tokens_param: str, after=None):
        try:
            return self.scheduler.submit(prepared.request, sink, after)
        except Overloaded as e:
            raise ApiError(str(e), None, 429, "requests", "rate_limit_exceeded") from None
        except ContextTooLong as e:
            raise context_error(e, prepared.prompt_param, max_tokens_param if prepared.sized else None) from None
        except TurboError as e:
            raise ApiError(str(e), param_of(e, max_tokens_param, prepared.forced)) from None

    def _turn(self, body: Body) -> Turn:
        """The chat's turn, its prompt rendered; a refusal as the request's 400."""
        if self.template is None:
            raise ApiError(f"this server's model {self.model} has no chat template (start it with "
                           "serve.chat_template=FILE.jinja); /v1/completions takes raw text", "messages")
        try:  # the library's rules (rt.chat, sessions): keywords the template reads, names its calls can carry
            check_template_kwargs(body.template_kwargs, self.template)
        except TurboError as e:
            raise ApiError(f"chat_template_kwargs.{e}", e.field and f"chat_template_kwargs.{e.field}") from None
        try:
            turn = Turn(self.template, self.stop_ids, body.tools, body.tool_choice)
        except TurboError as e:
            raise ApiError(str(e), e.field) from None
        try:
            turn.prepare(body.messages, body.template_kwargs)
        except TurboError as e:
            raise ApiError(str(e), e.field or ("tools" if "tools must be" in str(e) else "messages")) from None
        return turn

    @staticmethod
    def _ids(make, param: str) -> list[int]:
        try:
            return make()
        except TurboError as e:
            raise ApiError(str(e), param) from None
