"""Proof that a chat template outputs the contents of one shape of conversation verbatim, so that every
conversation of that shape renders as the placeholders' rendering with its contents filled in, without rendering
it: the template is run once on the placeholder conversation, compiled so that each step it takes with a message,
the message list or a content goes through this module, which lets it through only where the step's result is the
same for every content the guard passes (_ContentGuard: no such ends, no such texts, not such an equal) and is
a property of the shape otherwise (the roles, the number of messages). A step it cannot vouch for (the content's
length, a character of it, a filter that reads it, a comparison of two contents) ends the run: not proven, and the
caller renders each conversation as before.

What a content may meet: output (verbatim), `+` and `~` with texts and contents (the result only output or
joined further), truth (a content is never empty), type tests (`is string`), `trim`/`strip`/`lstrip`/`rstrip`
of characters the guard keeps off its ends, `startswith`/`endswith`/`in`/`split` of a text the guard keeps out
of it, `==`/`!=`/`in` against a text the guard keeps it from equalling. A message: its role and content, a key
it does not have (undefined, as for every conversation of the shape), `in` for a key. The message list: indexing,
slicing, iteration, length, first/last/list/reverse, selecting by role.

The template's own calls are run as they are (a template printing `strftime_now(...)` prints the date of its
shape's first rendering); `lipsum` (random) is not. Macros, call blocks, `{% set %}` blocks, filter blocks,
includes, imports and inheritance turn a rendering into text the template may then read: not proven.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_BLOCKED_NODES = (
    "Macro",
    "CallBlock",
    "FilterBlock",
    "AssignBlock",
    "Include",
    "Import",
    "FromImport",
    "Extends",
    "Block",
    "EvalContextModifier",
    "ScopedEvalContextModifier",
    "OverlayScope",
)
_TYPE_TESTS = frozenset(
    (
        "defined",
        "undefined",
        "none",
        "string",
        "mapping",
        "iterable",
        "sequence",
        "number",
        "integer",
        "float",
        "boolean",
        "true",
        "false",
        "callable",
        "escaped",
    )
)
_CONTENT_METHODS = frozenset(("strip", "lstrip", "rstrip", "startswith", "endswith", "split"))
_EQUALITY_TESTS = {"eq": "eq", "equalto": "eq", "==": "eq", "ne": "ne", "!=": "ne"}
_PYTHON_OPS = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "gt": lambda a, b: a > b,
    "gteq": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lteq": lambda a, b: a <= b,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}


class Unproven(Exception):
    """A step whose result could differ between contents the guard passes."""


class _Run:
    """One tracked rendering's verdict: the first step it could not vouch for (kept even if a caller of the
    step swallowed the exception)."""

    def __init__(self) -> None:
        self.unproven: str | None = None

    def refuse(self, why: str) -> Unproven:
        if self.unproven is None:
            self.unproven = why
        return Unproven(why)


_run: _Run | None = None  # the rendering in progress (renders are not reentrant)


def _refuse(why: str) -> Unproven:
    assert _run is not None, "a tracked value outside a tracked rendering"
    return _run.refuse(why)


class Content(str):
    """A message's content (`whole`), or a text joined from contents and texts. Every str operation refuses but
    those this module decides; output (`str()`) gives the placeholder text."""

    whole: bool

    def __new__(cls, text: str, whole: bool) -> Content:
        value = super().__new__(cls, text)
        value.whole = whole
        return value

    def __str__(self) -> str:
        return str.__str__(self)

    def __bool__(self) -> bool:
        return True  # the guard passes no empty content; a join holding one is not empty either


def _refusing(name: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"{type(self).__name__}.{name}")

    return refuse


# What reads a value whole: comparing, printing, formatting, pickling it.
_WHOLE_VALUE = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__repr__", "__format__")
_PICKLING = ("__reduce__", "__reduce_ex__")


def _refuse_all(cls: type, dunders: tuple[str, ...]) -> None:
    """Every public method of `cls`'s builtin base refuses, and these dunders."""
    base = cls.__bases__[0]
    for name in [n for n in dir(base) if not n.startswith("__")] + [*dunders, *_WHOLE_VALUE, *_PICKLING]:
        setattr(cls, name, _refusing(name))


_refuse_all(
    Content,
    (
        "__len__",
        "__iter__",
        "__getitem__",
        "__hash__",
        "__contains__",
        "__add__",
        "__radd__",
        "__mul__",
        "__rmul__",
        "__mod__",
        "__rmod__",
        "__int__",
        "__float__",
        "__complex__",
        "__index__",
        "__getnewargs__",
    ),
)


class Message(dict):
    """A placeholder message: its role and content are read through the environment; what would read every key
    or compare whole messages refuses."""

    def __bool__(self) -> bool:
        return True


_refuse_all(Message, ("__iter__", "__str__", "__or__", "__ror__", "__reversed__"))


class Messages(list):
    """The placeholder message list: indexing, slicing, iteration and length are properties of the shape."""

    def __getitem__(self, index: Any) -> Any:
        item = list.__getitem__(self, index)
        return Messages(item) if isinstance(index, slice) else item


_refuse_all(
    Messages, ("__contains__", "__str__", "__add__", "__radd__", "__mul__", "__rmul__", "__reversed__")
)

_TRACKED: tuple[type, ...] = (Content, Message, Messages)


def _holds_tracked(value: Any, depth: int = 0) -> bool:
    """Whether a value is or holds (in a list, tuple, dict, set or namespace) a tracked one; what it cannot look
    into (a generator, a loop) counts as holding one."""
    from jinja2.runtime import LoopContext
    from jinja2.utils import Namespace

    if isinstance(value, (*_TRACKED, _Selected, _GuardedMethod)) or depth > 20:
        return True
    if isinstance(value, (str, int, float, bool, type(None), range)):
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tracked(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tracked(k, depth + 1) or _holds_tracked(v, depth + 1) for k, v in value.items())
    if isinstance(value, Namespace):
        return _holds_tracked(object.__getattribute__(value, "_Namespace__attrs"), depth + 1)
    return isinstance(value, LoopContext) or hasattr(value, "__next__")


class _GuardedMethod:
    """`content.strip` and the like, bound: called through the environment's call."""

    def __init__(self, content: Content, name: str) -> None:
        self.content, self.name = content, name


class TemplateProof:
    """One template compiled for tracked renderings, with the guard whose sets the steps are checked against."""

    def __init__(self, environment: Any, template: str, guard: Any) -> None:
        from jinja2 import nodes
        from jinja2.compiler import CodeGenerator

        self.guard = guard
        self._plain_tests = dict(environment.tests)
        tree = environment.parse(template)
        blocked = [n for n in tree.find_all(nodes.Node) if type(n).__name__ in _BLOCKED_NODES]
        self.blocked = f"the template has a {type(blocked[0]).__name__}" if blocked else None
        if self.blocked:
            return

        class TrackedCodeGenerator(CodeGenerator):
            """Every comparison through environment.tracked_compare (Python's `in` reads a str argument's
            characters without asking it)."""

            def visit_Compare(self, node: Any, frame: Any) -> None:
                self.write("environment.tracked_compare(")
                self.visit(node.expr, frame)
                for op in node.ops:
                    self.write(f", {op.op!r}, ")
                    self.visit(op.expr, frame)
                self.write(")")

        tracked = environment.overlay()
        tracked.code_generator_class = TrackedCodeGenerator
        tracked.intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))
        tracked.intercepted_unops = frozenset(("+", "-"))
        plain_getattr, plain_getitem, plain_call = tracked.getattr, tracked.getitem, tracked.call
        plain_binop, plain_unop = tracked.call_binop, tracked.call_unop
        lipsum, namespace_class = environment.globals.get("lipsum"), environment.globals.get("namespace")

        def getattr_(obj: Any, attribute: str) -> Any:
            if isinstance(obj, Content):
                if obj.whole and attribute in _CONTENT_METHODS:
                    return _GuardedMethod(obj, attribute)
                raise _refuse(f"content.{attribute}")
            if isinstance(obj, Message):
                return _message_field(tracked, obj, attribute)
            if isinstance(obj, Messages):
                raise _refuse(f"messages.{attribute}")
            return plain_getattr(obj, attribute)

        def getitem(obj: Any, argument: Any) -> Any:
            if _holds_tracked(argument):
                raise _refuse("a subscript by a content")
            if isinstance(obj, Content):
                raise _refuse("content[...]")
            if isinstance(obj, Message):
                if not isinstance(argument, str):
                    raise _refuse("message[...] by a non-text key")
                return _message_field(tracked, obj, argument)
            if isinstance(obj, Messages):
                if isinstance(argument, bool) or not isinstance(argument, int):
                    raise _refuse("messages[...] by a non-integer")
                return obj[argument]
            return plain_getitem(obj, argument)

        def call(__context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            # the loop's and block's variables, passed for a pass_context callable, are not arguments
            scopes = {k: kwargs.pop(k) for k in ("_loop_vars", "_block_vars") if k in kwargs}
            if isinstance(__obj, _GuardedMethod):
                return self._method(__obj, args, kwargs)
            if lipsum is not None and __obj is lipsum:
                raise _refuse("lipsum()")
            holding = _holds_tracked(__obj) or _holds_tracked(args) or _holds_tracked(kwargs)
            if holding and (__obj is not namespace_class or args):  # namespace(name=content) only holds it
                raise _refuse(f"a call of {getattr(__obj, '__name__', type(__obj).__name__)} with a content")
            return plain_call(__context, __obj, *args, **kwargs, **scopes)

        def call_binop(context: Any, operator: str, left: Any, right: Any) -> Any:
            if not (_holds_tracked(left) or _holds_tracked(right)):
                return plain_binop(context, operator, left, right)
            # a Markup (|safe) would escape the other operand: only plain texts and contents
            if operator == "+" and all(type(x) is str or isinstance(x, Content) for x in (left, right)):
                return Content(str.__add__(str(left), str(right)), whole=False)
            raise _refuse(f"{operator} with a content")

        def call_unop(context: Any, operator: str, arg: Any) -> Any:
            if _holds_tracked(arg):
                raise _refuse(f"unary {operator} of a content")
            return plain_unop(context, operator, arg)

        tracked.getattr, tracked.getitem, tracked.call = getattr_, getitem, call
        tracked.call_binop, tracked.call_unop = call_binop, call_unop
        tracked.tracked_compare = self._compare
        tracked.filters = {name: self._filter(name, f) for name, f in environment.filters.items()}
        tracked.tests = {name: self._test(name, f) for name, f in environment.tests.items()}
        self.compiled = tracked.from_string(template)
        namespace = self.compiled.root_render_func.__globals__
        # `~` (markup_join only under autoescape, which a template cannot turn on here: no modifier nodes)
        namespace["str_join"] = namespace["markup_join"] = _join

    def render(
        self, roles: tuple[str, ...], contents: list[str], prefixes: list[tuple[int, bool]], variables: dict
    ) -> list[str] | None:
        """The placeholder conversation rendered for each (n, generation_prompt), and None where some step is
        not proven (then why in `self.unproven`)."""
        global _run
        self.unproven = self.blocked
        if self.blocked:
            return None
        messages = Messages(
            Message(role=role, content=Content(text, whole=True))
            for role, text in zip(roles, contents, strict=True)
        )
        _run = _Run()
        try:
            renders = [
                str(
                    self.compiled.render(
                        messages=messages[:n],
                        tools=None,
                        documents=None,
                        add_generation_prompt=prompt,
                        **variables,
                    )
                )
                for n, prompt in prefixes
            ]
        except Exception as e:  # Unproven, or the template's own error (then the plain renders raise it too)
            self.unproven = _run.unproven or f"{type(e).__name__}: {e}"
            return None
        finally:
            run, _run = _run, None
        self.unproven = run.unproven
        return None if run.unproven else renders

    # --- the steps ------------------------------------------------------------------------------------

    def _method(self, method: _GuardedMethod, args: tuple, kwargs: dict) -> Any:
        content, name, guard = method.content, method.name, self.guard
        if kwargs or _holds_tracked(args):
            raise _refuse(f"content.{name} with keywords or contents")
        if name in ("strip", "lstrip", "rstrip"):
            if len(args) > 1 or (args and args[0] is not None and not isinstance(args[0], str)):
                raise _refuse(f"content.{name}{args}")
            if args and args[0] is not None and not set(args[0]) <= guard.ends:
                raise _refuse(f"content.{name} of characters the guard does not keep off a content's ends")
            return content  # the guard's contents start and end with none of them, nor with whitespace
        if name in ("startswith", "endswith"):
            if len(args) != 1:
                raise _refuse(f"content.{name} with a range")
            texts = args[0] if isinstance(args[0], tuple) else (args[0],)
            if not all(isinstance(t, str) for t in texts):
                raise _refuse(f"content.{name} of a non-text")
            if any(t == "" for t in texts):
                return True
            self._kept_out(texts, content)
            return False
        # split
        if not args or not isinstance(args[0], str) or args[0] == "" or len(args) > 2:
            raise _refuse("content.split at whitespace or a non-text")
        if len(args) == 2 and (isinstance(args[1], bool) or not isinstance(args[1], int)):
            raise _refuse("content.split with a non-integer count")
        self._kept_out((args[0],), content)
        return [content]

    def _kept_out(self, texts: Any, content: Content) -> None:
        """Each text is one the guard keeps out of a content (and out of its placeholder)."""
        for text in texts:
            if text not in self.guard.inside or text in str.__str__(content):
                raise _refuse(f"a search for {text!r}, which the guard does not keep out of contents")

    def _equal_never(self, text: Any, content: Content) -> None:
        """`content == text` is False for every content the guard passes (and for its placeholder)."""
        if _holds_tracked(text):
            raise _refuse("a comparison of two contents")
        if isinstance(text, str) and (text not in self.guard.equal or str.__str__(content) == text):
            raise _refuse(f"a comparison with {text!r}, which the guard does not keep contents from")

    def _compare(self, left: Any, *rest: Any) -> bool:
        for op, right in zip(rest[::2], rest[1::2], strict=True):
            if not self._compare_one(left, op, right):
                return False
            left = right
        return True

    def _compare_one(self, left: Any, op: str, right: Any) -> bool:
        if not (_holds_tracked(left) or _holds_tracked(right)):
            return _PYTHON_OPS[op](left, right)
        if op in ("eq", "ne"):
            content, other = (left, right) if isinstance(left, Content) else (right, left)
            if not (isinstance(content, Content) and content.whole):
                raise _refuse(f"{op} of a message, the message list or a joined content")
            self._equal_never(other, content)
            return op == "ne"
        if op in ("in", "notin"):
            found = self._contains(right, left)
            return found if op == "in" else not found
        raise _refuse(f"{op} with a content")

    def _contains(self, container: Any, item: Any) -> bool:
        if isinstance(container, Content):
            if not container.whole or _holds_tracked(item) or not isinstance(item, str):
                raise _refuse("`in` a joined content, or of a non-text")
            if item == "":
                return True
            self._kept_out((item,), container)
            return False
        if isinstance(container, Message):
            if not isinstance(item, str):
                raise _refuse("`in` a message of a non-text")
            return dict.__contains__(container, item)  # its keys are the shape's
        if isinstance(item, Content) and item.whole:
            if isinstance(container, str):
                self._equal_never(container, item)  # the guard: a content inside none of its equals
                return False
            if isinstance(container, (list, tuple)) and not _holds_tracked(container):
                for element in container:
                    self._equal_never(element, item)
                return False
        raise _refuse("`in` with a content, a message or the message list")

    def _filter(self, name: str, function: Any) -> Any:
        return _tracking(
            function, lambda passed, values, kwargs: self._tracked_filter(name, values[0], values[1:], kwargs)
        )

    def _tracked_filter(self, name: str, value: Any, args: tuple, kwargs: dict) -> Any:
        if _holds_tracked(args) or _holds_tracked(kwargs):
            raise _refuse(f"|{name} with a content as an argument")
        if isinstance(value, Content):
            if name == "string":
                return value
            if name == "trim" and value.whole:
                chars = args[0] if args else kwargs.get("chars")
                return self._method(_GuardedMethod(value, "strip"), (chars,) if chars is not None else (), {})
            raise _refuse(f"|{name} of a content")
        if isinstance(value, Message):
            if name in ("length", "count") and not args and not kwargs:
                return dict.__len__(value)
            raise _refuse(f"|{name} of a message")
        if isinstance(value, _Selected) and name in ("list", "first") and not args and not kwargs:
            items = Messages(value)
            if name == "list":
                return items
            if not items:
                raise _refuse("|first of no messages")
            return items[0]
        if isinstance(value, (list, tuple)) and not args and not kwargs:  # the messages, or a split content
            if name in ("length", "count"):
                return len(value)
            if name in ("first", "last"):
                if not len(value):
                    raise _refuse(f"|{name} of an empty list")
                return list.__getitem__(list(value), 0 if name == "first" else -1)
            if name == "list":
                return Messages(value) if isinstance(value, Messages) else list(value)
            if name == "reverse":
                return reversed(list(value))  # as jinja's: an iterator (a loop may run over it, no more)
        if isinstance(value, Messages) and name in ("selectattr", "rejectattr"):
            return self._by_role(name, value, args, kwargs)
        raise _refuse(f"|{name} of the message list or a list holding a content")

    def _by_role(self, name: str, messages: Messages, args: tuple, kwargs: dict) -> Messages:
        if kwargs or not args or args[0] != "role" or len(args) > 3:
            raise _refuse(f"|{name} by another field than role")
        test = self._plain_tests[args[1]] if len(args) > 1 else bool
        keep = [
            m
            for m in messages
            if bool(test(dict.__getitem__(m, "role"), *args[2:])) == (name == "selectattr")
        ]
        return _Selected(keep)

    def _test(self, name: str, function: Any) -> Any:
        def tracked_test(passed: tuple, values: tuple, kwargs: dict) -> Any:
            value, rest = values[0], values[1:]
            if name in _TYPE_TESTS and not rest and not kwargs:
                return function(*passed, _stand_in(value))  # a test of the type only
            if name in _EQUALITY_TESTS and len(rest) == 1 and not kwargs:
                return self._compare_one(value, _EQUALITY_TESTS[name], rest[0])
            raise _refuse(f"`is {name}` of a content, a message or the message list")

        return _tracking(function, tracked_test)


def _tracking(function: Any, tracked: Callable[[tuple, tuple, dict], Any]) -> Any:
    """A jinja filter or test as it is, but where its arguments hold a tracked value: then `tracked(passed,
    values, kwargs)` decides (`passed`: the context, environment or eval context jinja passes first, if any)."""
    first = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        passed, values = args[:first], args[first:]
        if not (_holds_tracked(values) or _holds_tracked(kwargs)):
            return function(*args, **kwargs)
        return tracked(passed, values, kwargs)

    if hasattr(function, "jinja_pass_arg"):
        wrapper.jinja_pass_arg = function.jinja_pass_arg  # type: ignore[attr-defined]
    return wrapper


def _stand_in(value: Any) -> Any:
    """A plain value of a tracked one's type, for a test that looks at the type only."""
    if isinstance(value, Content):
        return str.__str__(value)
    if isinstance(value, Message):
        return dict.copy(value)
    if isinstance(value, Messages):
        return list.copy(value)
    return value


class _Selected:
    """Messages selected by role: as jinja's select filters give them, an iterator; a loop or `|list` reads
    it."""

    def __init__(self, messages: list) -> None:
        self._items = iter(messages)

    def __iter__(self) -> _Selected:
        return self

    def __next__(self) -> Any:
        return next(self._items)


def _message_field(environment: Any, message: Message, name: str) -> Any:
    if name in ("role", "content"):
        return dict.__getitem__(message, name)
    if name in _DICT_NAMES:
        raise _refuse(f"message.{name}")
    return environment.undefined(
        obj=message, name=name
    )  # as for every message of the shape: it has no such key


_DICT_NAMES = frozenset(dir(dict))


def _join(seq: Any) -> str:
    """`~`: texts and contents joined; what would print a message, the list or a container holding a content
    refuses."""
    parts = list(seq)
    if not any(_holds_tracked(p) for p in parts):
        return "".join(map(str, parts))
    for p in parts:
        if _holds_tracked(p) and not isinstance(p, Content):
            raise _refuse("`~` of a message or a list")
    return Content("".join(str.__str__(p) if isinstance(p, Content) else str(p) for p in parts), whole=False)
