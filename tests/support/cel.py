"""A small evaluator for the subset of CEL the CRD's rules use, and the API server's structural
defaulting, so unit tests can check each CEL rule without an API server (tests/cluster/test_crd.py
checks them on a real one): `||`, `&&`, `!`, comparisons, parentheses, `self.a.b`, `has(self.a)`,
`%` and `*` on ints, int, bool and string literals, `.startsWith(s)`, `.contains(s)`,
`.matches(re)` (a search, as CEL's) and `.size()`."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

_TOKEN = re.compile(
    r"\s*(?:(?P<op>\|\||&&|==|!=|>=|<=|[<>!().,%*])|(?P<int>\d+)|'(?P<sq>[^']*)'|\"(?P<dq>[^\"]*)\""
    r"|(?P<ident>[A-Za-z_][A-Za-z0-9_]*))"
)


class CelError(Exception):
    """An expression outside the subset, or an evaluation error (e.g. a missing field)."""


def _tokens(expression: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    position = 0
    while position < len(expression.rstrip()):
        match = _TOKEN.match(expression, position)
        if match is None:
            raise CelError(f"cannot read {expression[position:]!r}")
        position = match.end()
        kind = match.lastgroup
        if kind == "op":
            out.append(("op", match["op"]))
        elif kind == "int":
            out.append(("value", int(match["int"])))
        elif kind in ("sq", "dq"):
            out.append(("value", match[kind]))
        else:
            word = match["ident"]
            out.append(("value", word == "true") if word in ("true", "false") else ("id", word))
    return out


Node = Callable[[], Any]


class _Parser:
    """Recursive descent into thunks, with CEL's precedence: || < && < relations < % < ! <
    member access; evaluating the root thunk evaluates the expression."""

    def __init__(self, expression: str, this: Any) -> None:
        self.tokens = _tokens(expression)
        self.position = 0
        self.this = this

    def peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, op: str | None = None) -> tuple[str, Any]:
        token = self.peek()
        if token is None or (op is not None and token != ("op", op)):
            raise CelError(f"expected {op or 'a token'} at {self.position}, found {token}")
        self.position += 1
        return token

    def parse(self) -> Node:
        node = self.logical("||")
        if self.peek() is not None:
            raise CelError(f"unexpected {self.peek()}")
        return node

    def logical(self, op: str) -> Node:
        nodes = [self._operand(op)]
        while self.peek() == ("op", op):
            self.take()
            nodes.append(self._operand(op))
        if len(nodes) == 1:
            return nodes[0]
        decides = op == "||"

        def run() -> Any:
            # CEL's commutative || and &&: a deciding operand wins over an error in another.
            error: CelError | None = None
            for node in nodes:
                try:
                    value = node()
                except CelError as caught:
                    error = caught
                    continue
                if not isinstance(value, bool):
                    raise CelError(f"{op} needs booleans, got {value!r}")
                if value is decides:
                    return decides
            if error is not None:
                raise error
            return not decides

        return run

    def _operand(self, op: str) -> Node:
        return self.logical("&&") if op == "||" else self.relation()

    def relation(self) -> Node:
        left = self.remainder()
        token = self.peek()
        if token is None or token[0] != "op" or token[1] not in ("==", "!=", ">=", "<=", ">", "<"):
            return left
        self.take()
        right = self.remainder()
        op = token[1]

        def run() -> Any:
            a, b = left(), right()
            if op in ("==", "!="):
                return (a == b) == (op == "==")
            if type(a) is not type(b):
                raise CelError(f"cannot order {a!r} and {b!r}")
            return {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}[op]

        return run

    def remainder(self) -> Node:
        node = self.unary()
        while self.peek() in (("op", "%"), ("op", "*")):
            _, op = self.take()
            node = (self._modulo if op == "%" else self._product)(node, self.unary())
        return node

    @staticmethod
    def _product(left: Node, right: Node) -> Node:
        def run() -> Any:
            a, b = left(), right()
            if not all(type(v) is int for v in (a, b)):
                raise CelError(f"* needs ints, got {a!r} and {b!r}")
            return a * b

        return run

    @staticmethod
    def _modulo(left: Node, right: Node) -> Node:
        def run() -> Any:
            a, b = left(), right()
            # CEL's int % int; bool is an int subclass in Python, not in CEL.
            if not all(type(v) is int for v in (a, b)):
                raise CelError(f"% needs ints, got {a!r} and {b!r}")
            if b == 0:
                raise CelError("modulus by zero")
            # CEL's remainder takes the dividend's sign (truncated division); Python's % floors.
            remainder = abs(a) % abs(b)
            return -remainder if a < 0 else remainder

        return run

    def unary(self) -> Node:
        if self.peek() != ("op", "!"):
            return self.member()
        self.take()
        operand = self.unary()

        def run() -> Any:
            value = operand()
            if not isinstance(value, bool):
                raise CelError(f"! needs a boolean, got {value!r}")
            return not value

        return run

    def member(self) -> Node:
        node = self.primary()
        while self.peek() == ("op", "."):
            self.take()
            _, name = self.take()
            if self.peek() == ("op", "("):
                self.take("(")
                arguments: list[Node] = []
                while self.peek() != ("op", ")"):
                    arguments.append(self.logical("||"))
                    if self.peek() == ("op", ","):
                        self.take()
                self.take(")")
                node = self._call(node, name, arguments)
            else:
                node = self._field(node, name)
        return node

    @staticmethod
    def _field(node: Node, name: str) -> Node:
        def run() -> Any:
            value = node()
            if not isinstance(value, dict) or name not in value:
                raise CelError(f"no such key: {name}")
            return value[name]

        return run

    @staticmethod
    def _call(node: Node, name: str, arguments: list[Node]) -> Node:
        def run() -> Any:
            value, args = node(), [argument() for argument in arguments]
            if name == "startsWith" and isinstance(value, str) and len(args) == 1:
                return value.startswith(args[0])
            if name == "contains" and isinstance(value, str) and len(args) == 1:
                return args[0] in value
            if name == "matches" and isinstance(value, str) and len(args) == 1:
                return re.search(args[0], value) is not None
            if name == "size" and not args:
                return len(value)
            raise CelError(f"unsupported call {name}{tuple(args)} on {value!r}")

        return run

    def primary(self) -> Node:
        kind, token = self.take()
        if kind == "value":
            return lambda: token
        if (kind, token) == ("op", "("):
            node = self.logical("||")
            self.take(")")
            return node
        if (kind, token) == ("id", "self"):
            return lambda: self.this
        if (kind, token) == ("id", "has"):
            self.take("(")
            target = self.primary()
            path: list[str] = []
            while self.peek() == ("op", "."):
                self.take()
                path.append(self.take()[1])
            self.take(")")
            if not path:
                raise CelError("has() needs a field selection")
            for name in path[:-1]:
                target = self._field(target, name)
            last = path[-1]
            return lambda: isinstance(value := target(), dict) and last in value
        raise CelError(f"unexpected {token!r}")


def evaluate(expression: str, this: Any) -> Any:
    """The value of `expression` with `self` bound to `this` (JSON data)."""
    return _Parser(expression, this).parse()()


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """`value` with the structural schema's defaults filled in, as the API server does before it
    runs CEL rules: a missing property with a default gets it, then its own nested defaults."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value
