"""The tracer behind scripts/walk.py: which product files a walk's data passes through, from the running code.

A profiler in every thread follows the data from stop to stop. A file of engine/ or strata_tui/ is on the walk's
path when

- the data comes down the call stack through it to a stop (a function the data is known to reach), or one of the
  calls on the stack at a stop holds the data in its frame;
- or one of its functions is a station on the way: handed the data (or something made from it) as an argument,
  it made something that the data reached the last stop in (followed back from the last stop's arguments through
  what each object was made from).

What a function handed the data returns is data too, and so is an object constructed from it. Not a station: a
method of the data itself (a Request's property, a plan's field: the data's own type is where it lives), and a
function that only looks at the data (the telemetry of a request, its metrics: nothing it made reaches the end).
A stop counts once the stops before it were met and it is handed the data; the first starts the data, and a
bridge starts it again (the other side of a socket; a number, which no profiler can follow by identity).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "strata_tui")
_SCALARS = (int, float, bool, str, bytes, type(None))  # hold nothing
_LOOK_INTO = 16  # elements of a container (or fields of a dataclass) looked at for data


class Walk:
    """The walk's path over every thread, while armed (see the module docstring)."""

    def __init__(self, stops: list[Callable[..., Any] | ModuleType],
                 bridges: tuple[Callable[..., Any] | ModuleType, ...] = (), born: bool = False) -> None:
        """`stops`: where the data is to be met, in order. The first, and each of `bridges` (the other side of a
        socket, or a number that no profiler can follow), starts the data afresh from its arguments, and the
        whole stack there counts (the data came down it), unless the data is `born` at the first stop (then only
        its callers that hold the data count). Any other stop counts once it is handed data, with the callers on
        its stack that hold the data."""
        self.codes: set[CodeType] = set()
        self.files: set[str] = set()
        for stop in stops:
            if isinstance(stop, ModuleType):
                self.files.add(str(Path(stop.__file__).resolve()))
            else:
                self.codes.add(inspect.unwrap(stop).__code__)
        self.seeds = {_key_of(stop) for stop in (stops[0], *bridges)}
        self.born = _key_of(stops[0]) if born else None
        self._seq = itertools.count()  # the order files are met in
        self.met: dict[str, int] = {}  # a file on the path -> when it was first met
        self.order = [_key_of(stop) for stop in stops]
        self.hit: set[CodeType | str] = set()
        self.lock = threading.Lock()
        self.armed = False  # the profiler is on in every thread from the start; the walk counts once armed
        self.last = stops[-1]
        self.entered: dict[str, None] = {}  # every file a call entered while armed, in any thread
        self._data: dict[int, Any] = {}  # id -> the object (held, so that no id is reused while the walk runs)
        # frames handed data (what they return is data): the station they may be, and the data they were handed
        self._carriers: dict[int, tuple[str | None, list[int]]] = {}
        # data id -> what made it: (the station's file, its function, when) or None, and the data it was made from
        self._sources: dict[int, list[tuple[tuple[str, str, int] | None, list[int]]]] = {}
        self.stations: dict[str, str] = {}  # a station's file -> the function that made it one

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.armed:
            return
        if event == "return":
            if id(frame) in self._carriers:
                with self.lock:
                    station, inputs = self._carriers.pop(id(frame))
                    if _carries(arg, frame):
                        self._adopt(arg)
                        self._made(arg, station and (station, frame.f_code.co_qualname, next(self._seq)), inputs)
            return
        if event != "call":
            return
        code = frame.f_code
        rel = product_path(code.co_filename)
        if rel is None:
            return
        if rel not in self.entered:
            with self.lock:
                self.entered.setdefault(rel, None)
        key = code if code in self.codes else code.co_filename if code.co_filename in self.files else None
        if key is not None and self._due(key):
            self._at_stop(frame, key)
            if not self.armed:
                return
        self._follow(frame, rel)

    def _due(self, key: CodeType | str) -> bool:
        """A stop counts once the stops before it were met (the data goes through them in order)."""
        return all(earlier in self.hit for earlier in self.order[:self.order.index(key)])

    def _at_stop(self, frame: FrameType, key: CodeType | str) -> None:
        args = _arguments(frame)[1]
        with self.lock:
            if key not in self.seeds and not any(self._found(value) for value in args):
                return  # not the walk's data: this stop is met later
        with self.lock:
            self.hit.add(key)
            if key in self.seeds:
                for value in args:
                    self._adopt(value)
            whole = key in self.seeds and key != self.born
            stack = []
            outer: FrameType | None = frame
            while outer is not None:
                if outer is frame or whole or any(self._found(v, 2) for v in list(outer.f_locals.values())):
                    stack.append(outer.f_code.co_filename)
                outer = outer.f_back
            for name in reversed(stack):
                rel = product_path(name)
                if rel is not None:
                    self.met.setdefault(rel, next(self._seq))
            if key == self._last:
                self.armed = False  # the walk ends at its last stop
                self._trace_back(args)

    def _follow(self, frame: FrameType, rel: str) -> None:
        """A product function handed data is a station when what it returns carries the data on (an object, not
        None or a number), unless the data is only the object whose method it is (the data's own type is where it
        lives) or it constructs an object from the data. What a call handed data returns is data too."""
        receiver, args = _arguments(frame)
        with self.lock:
            inputs = [found for value in args for found in self._found(value)]
            own = receiver is not None and id(receiver) in self._data
            if not inputs and not own:
                return
            if inputs and frame.f_code.co_name in ("__init__", "__post_init__"):
                self._adopt(receiver)  # made from the data
                self._made(receiver, None, inputs)
                return
            station = rel if inputs and not own else None
            self._carriers[id(frame)] = (station, inputs + ([id(receiver)] if own else []))

    def _found(self, value: Any, depth: int = 3) -> list[int]:
        """The data `value` is or holds a few levels down (a container's elements, a dataclass's fields)."""
        if id(value) in self._data:
            return [id(value)]
        if depth == 0 or isinstance(value, _SCALARS):
            return []
        return [found for child in _children(value) for found in self._found(child, depth - 1)]

    def _adopt(self, value: Any, depth: int = 2) -> None:
        """`value` is data from now on, and so are its parts (a Prepared's requests, a request's parameters). Not
        what is shared by everything: numbers, None, short strings, empty containers (the empty tuple is one
        object), classes, modules and functions."""
        if id(value) in self._data or not _adoptable(value):
            return
        self._data[id(value)] = value
        if depth:
            for child in _children(value):
                if id(child) not in self._data:  # a part first met inside `value` came with it
                    self._adopt(child, depth - 1)
                    self._made(child, None, [id(value)])

    def _made(self, value: Any, station: tuple[str, str, int] | None, inputs: list[int]) -> None:
        """`value` was made from `inputs` (by a function of `station`'s file, or by the data itself)."""
        if id(value) in self._data:
            self._sources.setdefault(id(value), []).append((station, inputs))

    def _trace_back(self, ends: list[Any]) -> None:
        """The stations on the way from the walk's first data to its end: back from the last stop's arguments
        through what each was made from. A function that only looks at the data (telemetry of a request, its
        metrics) made nothing that reached the end."""
        todo = [found for value in ends for found in self._found(value)]
        done: set[int] = set()
        while todo:
            item = todo.pop()
            if item in done:
                continue
            done.add(item)
            for station, inputs in self._sources.get(item, ()):
                if station is not None:
                    self.stations.setdefault(station[0], station[1])
                    self.met[station[0]] = min(self.met.get(station[0], station[2]), station[2])
                todo.extend(inputs)

    @property
    def path(self) -> list[str]:
        """The files on the path, in the order first met."""
        return sorted(self.met, key=self.met.__getitem__)

    @functools.cached_property
    def _last(self) -> CodeType | str:
        return _key_of(self.last)

    def install(self) -> None:
        """Profile every thread started from now on (the engine's and the server's)."""
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def __enter__(self) -> "Walk":
        self.armed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.armed = False

    def first(self, path: str) -> None:
        """A file the walk starts in that is on no stack (a key binding is a declaration, not a call)."""
        self.met[path] = -1

    def missed(self) -> int:
        return len(self.codes | self.files) - len(self.hit)


def _key_of(stop: Callable[..., Any] | ModuleType) -> CodeType | str:
    if isinstance(stop, ModuleType):
        return str(Path(stop.__file__).resolve())
    return inspect.unwrap(stop).__code__


def _arguments(frame: FrameType) -> tuple[Any, list[Any]]:
    """A call's receiver (`self` or `cls`, or None) and its other arguments."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    names = code.co_varnames[:count]
    local = frame.f_locals
    values = [local[name] for name in names if name in local]
    if names and names[0] in ("self", "cls") and values:
        return values[0], values[1:]
    return None, values


def _adoptable(value: Any) -> bool:
    if isinstance(value, str):  # a prompt or a reply; not a word or a short string: those are shared (interned)
        return len(value) > 3 and not value.isidentifier()
    if isinstance(value, (int, float, bool, bytes, type(None), type, ModuleType)) or callable(value):
        return False
    return not (isinstance(value, (tuple, list, dict, set, frozenset)) and not value)


def _carries(result: Any, frame: FrameType) -> bool:
    """A call's result can carry the data on: an object, or each value a generator or coroutine yields (not
    None, a number or a flag: what a function that only looks at the data, to publish or count it, returns)."""
    if frame.f_code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
        return result is not None
    return not isinstance(result, (int, float, bool, type(None)))


def _children(value: Any) -> list[Any]:
    closure = getattr(value, "__closure__", None)
    if closure:  # a function made to carry the data (a command for the engine thread)
        return [cell.cell_contents for cell in closure[:_LOOK_INTO] if cell.cell_contents is not None]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(itertools.islice(value, _LOOK_INTO))
    if isinstance(value, dict):
        return list(itertools.islice(value.values(), _LOOK_INTO))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)[:_LOOK_INTO]]
    fields = getattr(type(value), "model_fields", None)  # a pydantic model (the HTTP bodies)
    if isinstance(fields, dict):
        return [getattr(value, name, None) for name in fields]
    return []


@functools.lru_cache(maxsize=None)
def product_path(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] in PACKAGES else None
