"""The interactive chat of ``torch-npu2 generate``: Ctrl-C stops an answer (or drops the line being typed) and
returns to the prompt, Ctrl-C twice in a row or Ctrl-D quits, ``/reset`` starts a new conversation, ``/exit``
quits. Line editing and history come from ``readline`` when the input is a terminal."""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

HELP = "Ctrl-C stops an answer, /reset starts over, /exit or Ctrl-D quits"


def enable_line_editing() -> bool:
    """Arrow keys, editing and in-session history for ``input()``; only on a terminal (readline writes escape
    codes otherwise) and only where the readline module exists."""
    if not sys.stdin.isatty():
        return False
    try:
        import readline  # noqa: F401  (importing it is what hooks it into input())
    except ImportError:
        return False
    return True


@contextmanager
def ctrl_c_sets(cancel: threading.Event) -> Iterator[None]:
    """While inside, Ctrl-C sets ``cancel`` (generation then ends after the current token) instead of raising
    KeyboardInterrupt wherever the interpreter is: Python drops an exception raised in a weakref callback, and the
    runtime returns buffers to its pool in one, so such a Ctrl-C would be lost and the answer would run on. A
    second Ctrl-C before the answer ends raises KeyboardInterrupt as usual. Outside the main thread (where
    signal handlers cannot be set) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame):
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class RefusedTurn(Exception):
    """Raised by a chat's ``reply`` for a message it will not answer (the conversation no longer fits the model's
    context): the message is dropped and the chat goes on."""


class ChatLoop:
    """``reply(messages)`` streams and returns the assistant's answer; a KeyboardInterrupt out of it means the
    user stopped that answer, whose turn is then dropped from the conversation (the model never sees a
    half-written answer as its own), as is a turn it refuses (RefusedTurn)."""

    def __init__(self, reply: Callable[[list[dict]], str], system: str | None = None,
                 read_line: Callable[[str], str] | None = None, err: TextIO | None = None,
                 out: TextIO | None = None):
        self.reply = reply
        self.system = system
        self.read_line = read_line or input
        self.err = err
        self.out = out  # where read_line's prompt goes (input() writes it to stdout)
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _say(self, text: str) -> None:
        print(text, file=self.err or sys.stderr, flush=True)

    def run(self) -> int:
        self._say(f"chat ({HELP})")
        interrupted_at_prompt = False
        while True:
            try:
                line = self.read_line("you> ")
            except EOFError:  # end the prompt's line where it was written: stdout, when input is piped
                print(file=self.out or sys.stdout, flush=True)
                return 0
            except KeyboardInterrupt:
                if interrupted_at_prompt:
                    self._say("")
                    return 0
                interrupted_at_prompt = True
                self._say("\n(Ctrl-C again or Ctrl-D to quit)")
                continue
            interrupted_at_prompt = False
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if text in ("/exit", "/quit"):
                    return 0
                if text == "/reset":
                    self.reset()
                    self._say("(new conversation)")
                else:
                    self._say(f"unknown command {text.split()[0]}: /reset starts over, /exit quits")
                continue
            self.messages.append({"role": "user", "content": text})
            try:
                answer = self.reply(self.messages)
            except KeyboardInterrupt:
                self.messages.pop()
                self._say("\n(answer stopped; that turn is left out of the conversation)")
                continue
            except RefusedTurn as refused:
                self.messages.pop()
                self._say(f"({refused}; that message is left out of the conversation, /reset starts over)")
                continue
            self.messages.append({"role": "assistant", "content": answer})
