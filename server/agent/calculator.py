"""The built-in ``calculator`` tool: arithmetic over a parsed expression tree, never eval.

The expression is parsed with ``ast`` and only number literals, the arithmetic operators, a few
math functions and constants are evaluated; everything else is refused with a ValueError the model
reads as the tool's error. The model writes the input, so every dimension of the work is bounded:
the text's length, the tree's size and depth, and the size of each integer (checked before a power
is computed, so ``9**9**9`` is refused instead of hanging).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from protoserve.server.tool_calls.call import ToolSpec

NAME = "calculator"
MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 1000
MAX_DEPTH = 200
# Integers stay exact up to here (about 300 digits), which also keeps every one convertible to a float.
MAX_INT_BITS = 1000

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


MAX_ROUND_DIGITS = 400  # past it the result no longer changes, but int rounding still costs 10**n


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int):
        raise ValueError("ndigits must be an integer")
    if abs(ndigits) > MAX_ROUND_DIGITS:
        raise ValueError(f"ndigits must be between -{MAX_ROUND_DIGITS} and {MAX_ROUND_DIGITS}")
    return round(x, ndigits)


def _min(*args: Number) -> Number:
    if not args:
        raise ValueError("needs at least one argument")
    return min(args)


def _max(*args: Number) -> Number:
    if not args:
        raise ValueError("needs at least one argument")
    return max(args)


_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": _round,
    "min": _min,
    "max": _max,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
}

# Friendlier names than the node classes for what is refused most often.
_REFUSED = {
    ast.Attribute: "attribute access is",
    ast.Subscript: "subscripts are",
    ast.Lambda: "lambdas are",
    ast.ListComp: "comprehensions are",
    ast.SetComp: "comprehensions are",
    ast.DictComp: "comprehensions are",
    ast.GeneratorExp: "comprehensions are",
    ast.Compare: "comparisons are",
    ast.BoolOp: "boolean operators are",
    ast.IfExp: "conditional expressions are",
    ast.NamedExpr: "assignment expressions are",
    ast.JoinedStr: "strings are",
    ast.List: "lists are",
    ast.Tuple: "tuples are",
    ast.Set: "sets are",
    ast.Dict: "dicts are",
}

# Numbers, operators, brackets and the known names, nothing else, so that a forced call's grammar holds the
# model to an expression (a small model otherwise writes JSON punctuation into the string): it starts after
# at most minus signs and brackets, has commas only after a function's "(", and ends with a digit, a constant
# or a ")" that closes something. A regular language cannot balance brackets: the parser still refuses
# what this lets through.
_NAMES = "|".join(sorted(_FUNCTIONS.keys() | _CONSTANTS.keys()))
_ATOMS = f"(?:[0-9]|{_NAMES})"
_BODY = f"(?:[0-9.+\\-*/%() ]|{_NAMES})*"
_ARGUMENTS = f"(?:[0-9.+\\-*/%(), ]|{_NAMES})*"
_CALL = f"(?:{'|'.join(sorted(_FUNCTIONS))})\\("
_VALUE = f"(?:[0-9]|{'|'.join(sorted(_CONSTANTS))})"
_MIDDLE = f"(?:(?:{_ATOMS}{_BODY})?{_CALL}{_ARGUMENTS}|{_ATOMS}{_BODY})"
EXPRESSION_PATTERN = f"^[-( ]*(?:{_MIDDLE}(?:{_VALUE}|\\))|{_VALUE})$"

SPEC = ToolSpec(
    name=NAME,
    description=(
        "Evaluates an arithmetic expression and returns the number. Supports + - * / // % ** and "
        "parentheses, the functions sqrt, abs, round, min, max, floor, ceil, log, exp, sin, cos, tan "
        "and the constants pi and e."
    ),
    parameters={
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                # In the schema too, so a forced call's grammar ends the string: a small model
                # otherwise writes until max_tokens.
                "maxLength": 200,
                "pattern": EXPRESSION_PATTERN,
                "description": 'The expression, in Python syntax, e.g. "(2 + 3) * sqrt(16) / 2".',
            }
        },
        "required": ["expression"],
        "additionalProperties": False,
    },
)


def evaluate(expression: str) -> Number:
    """The value of ``expression``; ValueError says why one is refused or cannot be computed."""
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(expression)} characters; the limit is {MAX_EXPRESSION_CHARS}")
    if not expression.strip():
        raise ValueError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not a valid expression: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ValueError("expression is nested too deeply") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise ValueError(f"expression has {nodes} syntax nodes; the limit is {MAX_NODES}")
    return _eval(tree.body, 0)


def format_number(value: Number) -> str:
    """Integers exactly, floats as Python's shortest round-trip repr."""
    return str(value) if isinstance(value, int) else repr(value)


def calculate(arguments: dict[str, Any]) -> str:
    """The tool's entry: ``{"expression": ...}`` to the number as text."""
    return format_number(evaluate(arguments["expression"]))


def _eval(node: ast.expr, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ValueError(f"expression is nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, ast.Constant):
        return _literal(node.value)
    if isinstance(node, ast.BinOp):
        # A long sum nests on its left; walking that spine in a loop keeps "1+2+...+300" shallow.
        spine = [node]
        while isinstance(spine[-1].left, ast.BinOp):
            spine.append(spine[-1].left)
        value = _eval(spine[-1].left, depth + 1)
        for binop in reversed(spine):
            value = _binary(binop.op, value, _eval(binop.right, depth + 1))
        return value
    if isinstance(node, ast.UnaryOp):
        op = _UNARY.get(type(node.op))
        if op is None:
            raise ValueError(f"operator {type(node.op).__name__} is not supported")
        return op(_eval(node.operand, depth + 1))
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise ValueError(f"unknown name {node.id!r}; the constants are {', '.join(sorted(_CONSTANTS))}")
    if isinstance(node, ast.Call):
        return _call(node, depth)
    what = _REFUSED.get(type(node), f"{type(node).__name__} is")
    raise ValueError(f"{what} not allowed; only numbers, operators and the named functions")


def _binary(op_node: ast.operator, left: Number, right: Number) -> Number:
    op = _BINARY.get(type(op_node))
    if op is None:
        raise ValueError(f"operator {type(op_node).__name__} is not supported")
    if isinstance(op_node, ast.Pow):
        _check_power(left, right)
    return _checked(_apply(op, left, right))


def _literal(value: object) -> Number:
    # bool is an int subclass; True + 1 is not arithmetic the model should rely on.
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "strings" if isinstance(value, str | bytes) else f"{type(value).__name__} literals"
        raise ValueError(f"{kind} are not allowed; only numbers")
    return _checked(value)


def _call(node: ast.Call, depth: int) -> Number:
    if isinstance(node.func, ast.Attribute):
        raise ValueError("attribute access is not allowed; call sqrt(x), not math.sqrt(x)")
    if not isinstance(node.func, ast.Name):
        raise ValueError("only the named functions may be called: " + ", ".join(sorted(_FUNCTIONS)))
    name = node.func.id
    function = _FUNCTIONS.get(name)
    if function is None:
        raise ValueError(f"unknown function {name!r}; the functions are {', '.join(sorted(_FUNCTIONS))}")
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise ValueError(f"{name}: only positional arguments are allowed")
    args = [_eval(a, depth + 1) for a in node.args]
    return _checked(_apply(function, *args, name=name))


def _apply(function: Callable[..., Any], *args: Number, name: str = "") -> Any:
    prefix = f"{name}: " if name else ""
    try:
        return function(*args)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError(f"{prefix}result is too large") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{prefix}{exc}") from None


def _check_power(base: Number, exponent: Number) -> None:
    # A lower bound of the result's bits, known before the power is computed.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent >= MAX_INT_BITS:
            raise ValueError(f"result of {base} ** {exponent} is too large")


def _checked(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"result is not a real number ({type(value).__name__})")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"integer result is too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    return value
