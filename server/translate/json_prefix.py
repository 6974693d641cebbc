"""Whether a tool call's arguments, streamed piece by piece, are still the beginning of one JSON object.

A Messages stream's `input_json_delta`s must add up to a JSON object: the anthropic SDK parses the pieces so far
after each one and raises on text that no continuation can make valid. An OpenAI-compatible upstream's model may
write anything, so its pieces are checked as they pass, in one pass over each character (RFC 8259's grammar).
"""

from __future__ import annotations

WHITESPACE = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_ESCAPES = '"\\/bfnrt'
# A number may end (and the next character be read as what follows it) in these states only.
_NUMBER_ENDS = {"zero", "int", "frac", "exp_digits"}


class JsonObjectPrefix:
    """Fed the text in order; `feed` says whether all of it so far is the beginning (or the whole) of one JSON
    object, with nothing but whitespace after it. Once false, it stays false."""

    def __init__(self) -> None:
        self._state = "start"
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._key = False  # the string being read is an object's key
        self._rest = ""  # the rest of a literal (true, false, null) still to come
        self._hex = 0  # the hex digits of a \uXXXX escape still to come
        self.valid = True

    @property
    def started(self) -> bool:
        """Whether the object's `{` has been read (before it, only whitespace)."""
        return self._state != "start"

    def feed(self, text: str) -> bool:
        if self.valid:
            self.valid = all(self._step(char) for char in text)
        return self.valid

    def _step(self, char: str) -> bool:
        state = self._state
        if state == "string":
            if char == '"':
                self._state = "colon" if self._key else "after"
            elif char == "\\":
                self._state = "escape"
            return char >= " "  # control characters must be escaped
        if state == "escape":
            if char == "u":
                self._state, self._hex = "hex", 4
                return True
            self._state = "string"
            return char in _ESCAPES
        if state == "hex":
            self._hex -= 1
            if not self._hex:
                self._state = "string"
            return char in _HEX
        if state == "literal":
            if char != self._rest[0]:
                return False
            self._rest = self._rest[1:]
            if not self._rest:
                self._state = "after"
            return True
        if state in _NUMBER_ENDS or state in ("minus", "dot", "exp", "exp_sign"):
            if self._number(char):
                return True
            if state not in _NUMBER_ENDS:
                return False
            self._state = "after"  # the number ended: the character is what follows it
        if char in WHITESPACE:
            return True
        return self._structural(char)

    def _number(self, char: str) -> bool:
        """The next state of a number that goes on with `char`; False when `char` is not part of it."""
        state, digit = self._state, char in _DIGITS
        if state == "minus" and digit:
            self._state = "zero" if char == "0" else "int"
        elif state == "int" and digit or state in ("frac", "exp_digits") and digit:
            pass
        elif state in ("zero", "int") and char == ".":
            self._state = "dot"
        elif state == "dot" and digit:
            self._state = "frac"
        elif state in ("zero", "int", "frac") and char in "eE":
            self._state = "exp"
        elif state == "exp" and char in "+-":
            self._state = "exp_sign"
        elif state in ("exp", "exp_sign") and digit:
            self._state = "exp_digits"
        else:
            return False
        return True

    def _structural(self, char: str) -> bool:
        state = self._state
        if state == "start":
            return char == "{" and self._open(char)
        if state in ("key_or_end", "key"):
            if char == '"':
                self._state, self._key = "string", True
                return True
            return state == "key_or_end" and char == "}" and self._close(char)
        if state == "colon":
            self._state = "value"
            return char == ":"
        if state in ("value", "value_or_end"):
            if state == "value_or_end" and char == "]":
                return self._close(char)
            return self._value(char)
        # "after" a value: a comma or the end of its container; nothing after the whole object
        if not self._stack:
            return False
        if char == ",":
            self._state = "key" if self._stack[-1] == "{" else "value"
            return True
        return char in "}]" and self._close(char)

    def _value(self, char: str) -> bool:
        if char in "{[":
            return self._open(char)
        if char == '"':
            self._state, self._key = "string", False
        elif char == "-":
            self._state = "minus"
        elif char in _DIGITS:
            self._state = "zero" if char == "0" else "int"
        elif char in _LITERALS:
            self._state, self._rest = "literal", _LITERALS[char]
        else:
            return False
        return True

    def _open(self, char: str) -> bool:
        self._stack.append(char)
        self._state = "key_or_end" if char == "{" else "value_or_end"
        return True

    def _close(self, char: str) -> bool:
        if not self._stack or self._stack.pop() != {"}": "{", "]": "["}[char]:
            return False
        self._state = "after"
        return True
