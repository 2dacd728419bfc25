"""A safe arithmetic evaluator for the calculator tool of ``workflows/multi_turn.py``.

A small recursive-descent parser over a whitelist of characters; nothing is ever passed to
``eval``, ``exec`` or ``ast``. The grammar::

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | 'x' | '×' | '/' | '÷' | '//' | '%') unary)*
    unary  := ('-' | '+') unary | power
    power  := atom (('**' | '^') unary)?           (right-associative; -3**2 is -9, as in Python)
    atom   := NUMBER | '(' expr ')'
    NUMBER := digits with optional thousands commas and decimal part ("1,250.5"), or ".5"

Arithmetic is exact (``fractions.Fraction``). Limits, each an error with a reason:
``MAX_LENGTH`` characters, ``MAX_DEPTH`` nesting (parentheses, unary signs, powers),
``MAX_EXPONENT`` for integer exponents (fractional ones are refused), and ``MAX_MAGNITUDE``
for every intermediate value, checked before a power is computed so ``9**9**9`` costs
nothing. A ``$`` before a number and spaces are ignored, as models write them.
"""

from __future__ import annotations

import math
from fractions import Fraction

MAX_LENGTH = 200
MAX_DEPTH = 20
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**15
MAX_DECIMALS = 6

_MUL = {"*", "x", "×"}
_DIV = {"/", "÷"}


class CalcError(ValueError):
    """The expression was refused; ``reason`` says why in a few words."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        ch = text[pos]
        if ch in " \t\n$":
            pos += 1
        elif ch.isdigit() or (ch == "." and pos + 1 < len(text) and text[pos + 1].isdigit()):
            end = pos
            while end < len(text) and (text[end].isdigit() or text[end] in ".,"):
                # a comma only as a thousands separator: followed by exactly three digits
                if text[end] == "," and not (text[end + 1 : end + 4].isdigit() and not text[end + 4 : end + 5].isdigit()):
                    break
                end += 1
            number = text[pos:end].replace(",", "")
            if number.count(".") > 1:
                raise CalcError(f"malformed number '{text[pos:end]}'")
            tokens.append(number)
            pos = end
        elif text.startswith(("**", "//"), pos):
            tokens.append(text[pos : pos + 2])
            pos += 2
        elif ch in "+-*/%^()×÷x":
            tokens.append(ch)
            pos += 1
        else:
            raise CalcError(f"character {ch!r} at position {pos} is not allowed")  # short: the model reads it
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalcError("the expression ends too early")
        self.pos += 1
        return token

    def nested(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalcError(f"nesting deeper than {MAX_DEPTH} levels")

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = _checked(value + self.term() if op == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in _MUL | _DIV | {"//", "%"}:
            op = self.take()
            right = self.unary()
            if op in _MUL:
                value = _checked(value * right)
                continue
            if right == 0:
                raise CalcError("division by zero")
            value = _checked(value / right if op in _DIV else Fraction(value // right) if op == "//" else value % right)
        return value

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("**", "^"):
            self.take()
            self.nested()
            exponent = self.unary()
            self.depth -= 1
            return _power(base, exponent)
        return base

    def unary(self) -> Fraction:
        if self.peek() in ("-", "+"):
            sign = self.take()
            self.nested()
            value = self.unary()
            self.depth -= 1
            return -value if sign == "-" else value
        return self.power()

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            self.nested()
            value = self.expr()
            if self.take() != ")":
                raise CalcError("unbalanced parentheses")
            self.depth -= 1
            return value
        if token[0].isdigit() or token[0] == ".":
            return _checked(Fraction(token))
        raise CalcError(f"unexpected '{token}'")


def _checked(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"a value exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalcError("only integer exponents are allowed")
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent {exponent} exceeds {MAX_EXPONENT} in magnitude")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    # Bound the result before computing it: |base|**|e| in digits, from the logarithm.
    if base != 0 and abs(math.log10(abs(base))) * abs(int(exponent)) > math.log10(MAX_MAGNITUDE) + 1:
        raise CalcError(f"the power exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    return _checked(base ** int(exponent))


def format_number(value: Fraction) -> str:
    """An integer as is; otherwise a decimal rounded to ``MAX_DECIMALS`` places, zeros trimmed."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.{MAX_DECIMALS}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calculate(expression: str) -> str:
    """The value of ``expression`` as text; raises :class:`CalcError` with a reason."""
    if len(expression) > MAX_LENGTH:
        raise CalcError(f"expression too long ({len(expression)} > {MAX_LENGTH} characters)")
    tokens = _tokenize(expression)
    if not tokens:
        raise CalcError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise CalcError(f"unexpected '{parser.peek()}' after a complete expression")
    return format_number(value)
