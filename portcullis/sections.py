"""Settings declared once, as frozen dataclasses: read from YAML, described for editors and docs.

Owns: `@section` and `setting(...)`, with which a deployable declares each part of its
configuration file as a dataclass whose fields carry their documentation, parser and bounds;
`load`, which turns a located YAML mapping (portcullis.yamlconf) into those dataclasses and
reports *every* problem as `FILE:LINE: message`; `json_schema`, the JSON Schema (draft-07,
what the YAML language server validates with) of the same declarations, written by
`python -m portcullis.sections MODULE:CLASS TITLE FILE` (`make schema`); `reference`, their
Markdown tables; and `keys`, every key path they know (to check documentation against).

What a field is follows from its annotation:

    str                 a non-empty string (`parser=yamlconf.string` allows "")
    bool, int           true/false; an integer, bounded by `minimum`/`maximum`/`more_than`
    timedelta, Rate     a duration (`30s`, `5m`) or a rate (`100/s`), as yamlconf reads them
    Literal["a", "b"]   one of the values; an Enum of strings likewise
    tuple[T, ...]       a list; frozenset[T] too; `min_items` refuses a shorter one
    Mapping[str, T]     a mapping with free keys (`keys=` parses them), read into a FrozenDict
    a dataclass         a nested section; `tuple[Section, ...]` a list of sections
    X | None            may be absent (default None); `Section | Literal[False]` takes `false`

and anything else by its `parser=` (with its `schema=`, or the one `@accepts` gave the
parser). In a list or mapping the parser reads each item; a parser of the whole value is
given a type of its own (a NewType of dict, say).

Secrets (`secret=True`) stay out of repr(), messages, the schema and the reference; with
`from_file=True` a secret may be given instead as `KEY_file`, a file holding it. A command
that uses no secret loads with `secrets=False`: secrets whose variable or file is missing,
and `KEY_file` values, are then WITHHELD instead of read. A default that follows from other
values of the section is a `derive=` function of them.

A key that is absent, or written as `null`, takes the field's default; a field without one is
required. A value that is refused (a section too) is reported and replaced by the field's
default, so the rest of the section can still be checked; a section whose required value is
missing or refused is not built: a list leaves it out, and the section holding it takes its
default in turn, or is not built either when it has none. After a section is built, its
`validate(check)` method, if it has one, checks the rules that span several fields: it sees
the defaults that stood in for refused values, and `check.has(key)` tells what was written.

How a class is read is worked out once, on its first use (with every section inside it); a
declaration the loader cannot read raises TypeError then, naming the class and the field.
Sections are declared at module level, where their annotations can be resolved.

Knows nothing about the gateway or the authserver: their sections are declared there.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, Protocol, TypeVar, dataclass_transform, runtime_checkable

from . import yamlconf
from .yamlconf import WITHHELD, Incomplete, LocatedList, LocatedMap, Rate, Reader

T = TypeVar("T")

ROOT = "config"  # how messages name the top of the file: `config: x is required`
_SPEC = "portcullis.sections"
_MISSING: Any = dataclasses.MISSING


class _Failed:
    """What a value that could not be read becomes while the rest is still checked."""


_FAILED: Any = _Failed()
_DERIVED: Any = object()  # a field whose default `derive` computes once the others are read


# ---------------------------------------------------------------------------- declaring


@dataclasses.dataclass(frozen=True)
class Spec:
    """What `setting()` records in a field's metadata."""

    doc: str = ""
    parser: Callable[[Any], Any] | None = None
    schema: Mapping[str, Any] | None = None
    minimum: Any = None
    maximum: Any = None
    more_than: Any = None
    min_items: int = 0
    key: str | None = None
    keys: Callable[[Any], str] | None = None
    label: Callable[[Mapping[str, Any]], str | None] | None = None
    hint: str = ""
    secret: bool = False
    from_file: bool = False
    derive: Callable[[Mapping[str, Any]], Any] | None = None
    source: Literal["yaml", "line", "file"] = "yaml"


def setting(
    doc: str = "",
    *,
    default: Any = _MISSING,
    default_factory: Any = _MISSING,
    parser: Callable[[Any], Any] | None = None,
    schema: Mapping[str, Any] | None = None,
    minimum: Any = None,
    maximum: Any = None,
    more_than: Any = None,
    min_items: int = 0,
    key: str | None = None,
    keys: Callable[[Any], str] | None = None,
    label: Callable[[Mapping[str, Any]], str | None] | None = None,
    hint: str = "",
    secret: bool = False,
    from_file: bool = False,
    derive: Callable[[Mapping[str, Any]], Any] | None = None,
) -> Any:
    """A field of a section: its documentation, and how its YAML value is read.

    `default`/`default_factory` as for `dataclasses.field` (keyword only, so that type
    checkers see them); neither makes the key required. `parser` reads one value (each item
    of a list, each value of a mapping) and raises ValueError with the message to show;
    `schema` is the JSON Schema of what it accepts (needed when neither the parser nor the
    annotation tells); a `title` in it names the type in the reference. `minimum`,
    `maximum` (inclusive) and `more_than` (exclusive) bound a number or duration after
    parsing. `min_items` refuses a shorter list. `key` is the YAML key when it differs from
    the field's name. `keys` parses the keys of a mapping field. `label` names an item of a
    list of sections in messages (see `named`). `hint` follows "is required". `secret` keeps
    the value out of repr(), messages, the schema and the reference. `from_file` lets the
    value be given instead as `KEY_file`, the path of a file holding it (the Docker and
    Kubernetes secrets convention); a secret that is given but cannot be read (its
    variable or file missing, reported) is WITHHELD, as is one a command that uses no
    secret does not read. `derive` computes the default from the section's other values (a
    mapping of field names to what was read) when the key is not written; a `default`
    beside it is only what direct construction of the class gets.
    """
    if derive is not None and default is _MISSING and default_factory is _MISSING:
        default = None  # stands in for the derived value; never left in a loaded section
    spec = Spec(
        doc=doc,
        parser=parser,
        schema=schema,
        minimum=minimum,
        maximum=maximum,
        more_than=more_than,
        min_items=min_items,
        key=key,
        keys=keys,
        label=label,
        hint=hint,
        secret=secret,
        from_file=from_file,
        derive=derive,
    )
    return dataclasses.field(
        default=default, default_factory=default_factory, repr=not secret, metadata={_SPEC: spec}
    )


P = TypeVar("P", bound=Callable[[Any], Any])
_SCHEMA_OF = "__sections_schema__"


def accepts(schema: Mapping[str, Any]) -> Callable[[P], P]:
    """Give a value parser the JSON Schema of what it accepts, so that a field using it
    needs no `schema=` (a `title` in it names the type in the reference)."""

    def mark(parse: P) -> P:
        setattr(parse, _SCHEMA_OF, dict(schema))
        return parse

    return mark


def section_line() -> Any:
    """A field that holds the line where the section starts (not a YAML key)."""
    return dataclasses.field(default=0, metadata={_SPEC: Spec(source="line")})


def source_file() -> Any:
    """A field that holds the name of the file the section was read from (not a YAML key)."""
    return dataclasses.field(metadata={_SPEC: Spec(source="file")})


_DOCS: dict[type, str] = {}


@dataclass_transform(
    frozen_default=True,
    # section_line() is left out: its default is inside it, where type checkers do not look.
    field_specifiers=(setting, source_file, dataclasses.field),
)
def section(cls: type[T]) -> type[T]:
    """A frozen dataclass whose docstring describes the section in the schema and reference."""
    doc = cls.__doc__  # read before dataclass() writes a signature there
    built = dataclasses.dataclass(frozen=True)(cls)
    _DOCS[built] = inspect.cleandoc(doc) if doc else ""
    return built


def named(kind: str, key: str) -> Callable[[Mapping[str, Any]], str | None]:
    """A `label` for list items: `route 'orders'` when the item's `key` is a string."""

    def label(item: Mapping[str, Any]) -> str | None:
        value = item.get(key)
        return f"{kind} {value!r}" if isinstance(value, str) and value.strip() else None

    return label


@runtime_checkable
class Validates(Protocol):
    """A section with rules that span its fields (or the sections inside it).

    A section may also define a static `validate_partial(values, check)`: it is called
    instead when a field could not be read, with the fields that could, so that the rules
    that do not need the missing ones are still checked in the same pass."""

    def validate(self, check: Check) -> None: ...


# ---------------------------------------------------------------------------- kinds of value


# `${VAR}`, `${VAR:-default}` or `${file:PATH}` somewhere in the value (yamlconf expands them).
_VARIABLE = {"type": "string", "pattern": r"\$\{([A-Za-z_][A-Za-z0-9_]*(:-[^}]*)?|file:[^}]+)\}"}
_NUMBER = r"[0-9]+(\.[0-9]+)?"
_PARSERS: dict[Callable[[Any], Any], tuple[str, dict[str, Any]]] = {
    yamlconf.string: ("string", {"type": "string"}),
    yamlconf.non_empty_string: ("string", {"type": "string", "pattern": r"\S"}),
    yamlconf.secret: ("secret", {"type": "string", "pattern": r"\S"}),
    yamlconf.boolean: ("boolean", {"type": "boolean"}),
    yamlconf.duration: (
        "duration",
        {
            "anyOf": [
                {"type": "string", "pattern": rf"^\s*{_NUMBER}\s*(ms|s|m|h|d)\s*$"},
                {"enum": [0]},
            ]
        },
    ),
    yamlconf.rate: (
        "rate",
        {"type": "string", "pattern": rf"^\s*{_NUMBER}\s*/\s*({_NUMBER})?\s*(ms|s|m|h|d)\s*$"},
    ),
    yamlconf.size: (
        "size",
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {
                    "type": "string",
                    "pattern": rf"^\s*{_NUMBER}\s*(B|KiB|MiB|GiB|KB|MB|GB|k|K|M|G)?\s*$",
                },
            ]
        },
    ),
}
DURATION_SCHEMA = _PARSERS[yamlconf.duration][1]  # for parsers that refine a duration
_INTEGER = yamlconf.integer()
_PARSERS[_INTEGER] = ("integer", {"type": "integer"})
_BY_TYPE: dict[object, Callable[[Any], Any]] = {
    str: yamlconf.non_empty_string,
    bool: yamlconf.boolean,
    int: _INTEGER,
    timedelta: yamlconf.duration,
    Rate: yamlconf.rate,
}


def _kind_of(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


_HIDDEN = "is not valid (the value is not shown)"


def _show(value: Any) -> str:
    return yamlconf.duration_text(value) if isinstance(value, timedelta) else str(value)


class _Kind:
    """How one kind of YAML value is read, described in JSON Schema and named in the docs."""

    def structural(self) -> bool:
        """Whether the value is a section (or holds sections): its problems are then named
        from the section (`upstream: url is required`), not as a parent's value (`config.x`)."""
        return False

    def load(self, run: _Run, raw: Any, where: str, line: int) -> Any:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def name(self) -> str:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _Scalar(_Kind):
    parse: Callable[[Any], Any]
    type_schema: Mapping[str, Any]
    type_name: str
    minimum: Any = None
    maximum: Any = None
    more_than: Any = None
    secret: bool = False

    def load(self, run: _Run, raw: Any, where: str, line: int) -> Any:
        try:
            value = self.parse(raw)
            self._check_bounds(value)
        except ValueError as exc:
            shown = exc if not self.secret or self.parse is yamlconf.secret else _HIDDEN
            run.reader.problem(line, f"{where}: {shown}")
            return _FAILED
        return value

    def _check_bounds(self, value: Any) -> None:
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"must be at least {_show(self.minimum)}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"must be at most {_show(self.maximum)}")
        if self.more_than is not None and value <= self.more_than:
            raise ValueError(f"must be more than {_show(self.more_than)}")

    def schema(self) -> dict[str, Any]:
        own = {k: v for k, v in self.type_schema.items() if k != "title"}
        if own.get("type") == "integer":
            bounds = {"minimum": self.minimum, "maximum": self.maximum}
            own |= {k: v for k, v in bounds.items() if isinstance(v, int)}
            if isinstance(self.more_than, int):
                own["exclusiveMinimum"] = self.more_than
        return {"anyOf": [*_alternatives(own), _VARIABLE]}

    def name(self) -> str:
        text = str(self.type_schema.get("title", self.type_name))
        bounds = [
            f"at least {_show(self.minimum)}" if self.minimum is not None else "",
            f"at most {_show(self.maximum)}" if self.maximum is not None else "",
            f"more than {_show(self.more_than)}" if self.more_than is not None else "",
        ]
        return ", ".join([text, *(b for b in bounds if b)])


@dataclasses.dataclass(frozen=True)
class _Choice(_Kind):
    values: tuple[Any, ...]  # as written in YAML
    enum_type: type[enum.Enum] | None = None

    def load(self, run: _Run, raw: Any, where: str, line: int) -> Any:
        for value in self.values:
            if type(value) is type(raw) and value == raw:  # `true` is not 1
                return self.enum_type(value) if self.enum_type else value
        choices = ", ".join(_yaml_text(v) for v in self.values)
        run.reader.problem(line, f"{where}: {raw!r} is not one of {choices}")
        return _FAILED

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [{"enum": list(self.values)}, _VARIABLE]}

    def name(self) -> str:
        return " | ".join(f"`{_yaml_text(v)}`" for v in self.values)


@dataclasses.dataclass(frozen=True)
class _List(_Kind):
    item: _Kind
    container: Callable[[list[Any]], Any]
    min_items: int = 0

    def structural(self) -> bool:
        return self.item.structural()

    def load(self, run: _Run, raw: Any, where: str, line: int) -> Any:
        if not isinstance(raw, LocatedList):
            run.reader.problem(line, f"{where} must be a list, got {_kind_of(raw)}")
            return _FAILED
        if len(raw) < self.min_items:
            many = "one" if self.min_items == 1 else f"{self.min_items} items"
            run.reader.problem(line, f"{where}: list at least {many}")
        items = []
        for index, value in enumerate(raw):
            if isinstance(value, Incomplete):
                continue  # what is missing in it is reported once, by the reader
            item = self.item.load(run, value, f"{where}[{index}]", raw.item_lines[index])
            if item is not _FAILED:  # reported; the others are still checked
                items.append(item)
        return self.container(items)

    def schema(self) -> dict[str, Any]:
        own: dict[str, Any] = {"type": "array", "items": self.item.schema()}
        if self.min_items:
            own["minItems"] = self.min_items
        return own

    def name(self) -> str:
        return (
            "list of sections" if isinstance(self.item, _Section) else f"list of {self.item.name()}"
        )


class FrozenDict(dict[str, T]):
    """What a mapping field holds: a dict that cannot change, hashable like the frozen
    section holding it (when its values are)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("settings do not change once read")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse


@dataclasses.dataclass(frozen=True)
class _Map(_Kind):
    value: _Kind
    keys: Callable[[Any], str] | None

    def structural(self) -> bool:
        return self.value.structural()

    def load(self, run: _Run, raw: Any, where: str, line: int) -> Any:
        if not isinstance(raw, LocatedMap):
            run.reader.problem(line, f"{where} must be a mapping, got {_kind_of(raw)}")
            return _FAILED
        result = {}
        for key, value in raw.items():
            key_line = raw.key_lines.get(key, raw.line)
            try:
                name = self.keys(key) if self.keys else key
            except ValueError as exc:
                run.reader.problem(key_line, f"{where}: {exc}")
                continue
            if isinstance(value, Incomplete):
                continue
            item = self.value.load(run, value, f"{where}.{key}", key_line)
            if item is not _FAILED:
                result[name] = item
        return FrozenDict(result)

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": self.value.schema()}

    def name(self) -> str:
        return f"mapping to {self.value.name()}"


@dataclasses.dataclass(frozen=True)
class _Section(_Kind):
    cls: type
    label: Callable[[Mapping[str, Any]], str | None] | None = None

    def structural(self) -> bool:
        return True

    def load(self, run: _Run, raw: Any, where: str, line: int) -> Any:
        if not isinstance(raw, LocatedMap):
            run.reader.problem(line, f"{where} must be a mapping, got {_kind_of(raw)}")
            return _FAILED
        label = self.label(raw) if self.label else None
        return run.build(self.cls, raw, label or where)

    def schema(self) -> dict[str, Any]:
        fields = _plan(self.cls)
        own: dict[str, Any] = {"type": "object"}
        if _DOCS.get(self.cls):
            own["description"] = _DOCS[self.cls]
        own["properties"] = {}
        for f in fields:
            if f.spec.source == "yaml":
                own["properties"][f.key] = f.schema()
                if f.file_key:
                    own["properties"][f.file_key] = f.file_schema()
        yaml_fields = [f for f in fields if f.required and f.spec.source == "yaml"]
        required = [f.key for f in yaml_fields if not f.file_key]
        if required:
            own["required"] = required
        # A required value that may come from a file instead: the key or its KEY_file.
        either = [f for f in yaml_fields if f.file_key]
        if len(either) > 1:
            raise TypeError(f"{self.cls.__name__}: one required KEY_file alternative at most")
        if either:
            f = either[0]
            own["anyOf"] = [{"required": [f.key]}, {"required": [f.file_key]}]
        own["additionalProperties"] = False
        return own

    def name(self) -> str:
        return "section"


@dataclasses.dataclass(frozen=True)
class _Either(_Kind):
    """A few literal values (`false`) or one other kind (a section)."""

    literals: _Choice
    other: _Kind

    def structural(self) -> bool:
        return self.other.structural()

    def load(self, run: _Run, raw: Any, where: str, line: int) -> Any:
        for value in self.literals.values:
            if type(value) is type(raw) and value == raw:
                return value
        return self.other.load(run, raw, where, line)

    def schema(self) -> dict[str, Any]:
        return {
            "anyOf": [{"enum": list(self.literals.values)}, *_alternatives(self.other.schema())]
        }

    def name(self) -> str:
        return f"{self.other.name()} | {self.literals.name()}"


def _yaml_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    key: str
    kind: _Kind
    spec: Spec
    default: Any  # _MISSING when required
    default_factory: Any

    @property
    def required(self) -> bool:
        return self.default is _MISSING and self.default_factory is _MISSING

    @property
    def file_key(self) -> str | None:
        """The key naming a file that holds the value, where `from_file` allows one."""
        return f"{self.key}_file" if self.spec.from_file else None

    def file_schema(self) -> dict[str, Any]:
        return {
            "description": f"A file holding {self.key} (instead of the value itself).",
            "anyOf": [{"type": "string", "pattern": r"\S"}, _VARIABLE, {"type": "null"}],
        }

    def default_value(self) -> Any:
        return self.default if self.default is not _MISSING else self.default_factory()

    def where_in(self, where: str) -> str:
        """How messages name this field's value inside the section named `where`."""
        if self.kind.structural() and where == ROOT:
            return self.key  # top-level sections are `upstream`, not `config.upstream`
        return f"{where}.{self.key}"

    def default_json(self) -> Any:
        """The default as it would be written in the file; None when it cannot be."""
        if self.spec.derive is not None:
            return None  # it follows from other values
        value = self.default_value()
        if isinstance(self.kind, _Scalar) and self.kind.parse is yamlconf.size:
            return _size_text(value) if isinstance(value, int) else None
        return _json_value(value)

    def schema(self) -> dict[str, Any]:
        own = self.kind.schema()
        if self.spec.doc:  # the field's words about the key win over its section's in general
            own = {"description": self.spec.doc} | {
                k: v for k, v in own.items() if k != "description"
            }
        if not self.required:
            own = _optional(own)
            default = self.default_json()
            if default is not None and not self.spec.secret:
                own["default"] = default
        return own


def _alternatives(schema: Mapping[str, Any]) -> list[Any]:
    """The members of an `anyOf` that says nothing else, or the schema itself."""
    return list(schema["anyOf"]) if set(schema) == {"anyOf"} else [schema]


def _optional(schema: dict[str, Any]) -> dict[str, Any]:
    """A key with a default may also be null, or a variable that expands to nothing (`${X:-}`
    is read as null too): the default applies then, whatever the key holds otherwise."""
    described = {k: v for k, v in schema.items() if k == "description"}
    members = _alternatives({k: v for k, v in schema.items() if k != "description"})
    extra = [m for m in (_VARIABLE, {"type": "null"}) if m not in members]
    return {**described, "anyOf": [*members, *extra]}


def _size_text(value: int) -> str | int:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return value


def _json_value(value: Any) -> Any:
    """A default as it would be written in YAML; None when it cannot be shown."""
    if isinstance(value, bool | int | str):
        return value
    if isinstance(value, timedelta):
        return yamlconf.duration_text(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | frozenset | list):
        items = [_json_value(v) for v in value]
        return sorted(items) if isinstance(value, frozenset) else items
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if value is None or not any("__str__" in vars(k) for k in type(value).__mro__[:-1]):
        return None  # a section, or a value without a written form
    return str(value)


_PLANS: dict[type, tuple[_Field, ...]] = {}


def _plan(cls: type) -> tuple[_Field, ...]:
    """The fields of a section as the loader reads them; worked out once per class."""
    if cls not in _PLANS:
        _PLANS[cls] = _make_plan(cls)
    return _PLANS[cls]


def _make_plan(cls: type) -> tuple[_Field, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    try:
        hints = typing.get_type_hints(cls)
    except NameError as exc:  # a class declared in a function names what is not global
        raise TypeError(f"{cls.__name__}: {exc}; declare sections at module level") from None
    fields = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        spec = f.metadata.get(_SPEC, Spec())
        try:
            kind = _kind(hints[f.name], spec)
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{f.name}: {exc}") from None
        fields.append(_Field(f.name, spec.key or f.name, kind, spec, f.default, f.default_factory))
    keys = [f.key for f in fields if f.spec.source == "yaml"]
    if len(set(keys)) != len(keys):
        raise TypeError(f"{cls.__name__}: two fields read the same YAML key")
    return tuple(fields)


def _kind(annotation: Any, spec: Spec) -> _Kind:
    if spec.source != "yaml":
        return _Scalar(lambda v: v, {}, "")  # filled by the loader, never read from YAML
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _union(args, spec)
    if spec.label and not (origin is tuple and dataclasses.is_dataclass(args[0])):
        raise TypeError("label= is for lists of sections")
    if spec.keys and origin not in (dict, Mapping):
        raise TypeError("keys= is for mappings")
    if spec.min_items and origin not in (tuple, frozenset):
        raise TypeError("min_items= is for lists")
    if origin in (tuple, frozenset):
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            raise TypeError("a list is tuple[T, ...]")
        container: Callable[[list[Any]], Any] = tuple if origin is tuple else frozenset
        return _List(_item(args[0], spec), container, spec.min_items)
    if origin in (dict, Mapping):
        if args[0] is not str:
            raise TypeError("mapping keys are strings")
        return _Map(_item(args[1], spec), spec.keys)
    return _item(annotation, spec)


def _item(annotation: Any, spec: Spec) -> _Kind:
    """The kind of a single value: a section, an enumeration or a scalar."""
    known = annotation in _BY_TYPE  # Rate is a dataclass, but written as `100/s`
    if dataclasses.is_dataclass(annotation) and not (known or spec.parser):
        assert isinstance(annotation, type)
        _plan(annotation)  # a mistake in a nested declaration shows when its parent is planned
        return _Section(annotation, spec.label)
    if typing.get_origin(annotation) is Literal and not spec.parser:
        return _Choice(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum) and not spec.parser:
        return _Choice(tuple(m.value for m in annotation), annotation)
    parse = spec.parser or (yamlconf.secret if spec.secret else _BY_TYPE.get(annotation))
    if parse is None:
        raise TypeError(f"give parser= (and schema=) for {annotation!r}")
    name, schema = _PARSERS.get(parse, ("", {}))
    given = spec.schema if spec.schema is not None else getattr(parse, _SCHEMA_OF, None)
    if given is not None:
        schema = dict(given)
    elif not schema:
        fallback = _BY_TYPE.get(annotation)
        if fallback is None:
            raise TypeError(f"give schema= for the values the parser of {annotation!r} takes")
        name, schema = _PARSERS[fallback]
        schema = {k: v for k, v in schema.items() if k != "pattern"}
    if spec.secret:
        name = "secret"
    return _Scalar(
        parse,
        schema,
        name or str(schema.get("type", "value")),
        spec.minimum,
        spec.maximum,
        spec.more_than,
        spec.secret,
    )


def _union(args: tuple[Any, ...], spec: Spec) -> _Kind:
    options = [a for a in args if a is not type(None)]
    literals = [v for a in options if typing.get_origin(a) is Literal for v in typing.get_args(a)]
    others = [a for a in options if typing.get_origin(a) is not Literal]
    if len(others) > 1:
        raise TypeError("a union holds None, literals and at most one other type")
    if not others:
        return _Choice(tuple(literals))
    other = _kind(others[0], spec)
    return _Either(_Choice(tuple(literals)), other) if literals else other


# ---------------------------------------------------------------------------- loading


class Check:
    """What `validate()` is given: where the section is, and how to report a problem there."""

    def __init__(self, run: _Run, data: LocatedMap, where: str, fields: tuple[_Field, ...]):
        self._run = run
        self._data = data
        self._keys = {f.name: f.key for f in fields}
        self._file_keys = {f.name: f.file_key for f in fields if f.file_key}
        self.where = where
        self.line = data.line
        self.file = run.file
        # False for a command that uses no secret: files it names need not be checked.
        self.secrets = run.reader.secrets

    def _key(self, name: str) -> str:
        return self._keys.get(name, name)

    def _written_key(self, name: str) -> str:
        """The field's key, or its `KEY_file` variant where only that is written."""
        file_key = self._file_keys.get(name)
        if file_key and file_key in self._data and self._key(name) not in self._data:
            return file_key
        return self._key(name)

    def line_of(self, name: str) -> int:
        """The line of a field's key (or of its `KEY_file`), or of the section when neither
        is written."""
        return self._data.key_lines.get(self._written_key(name), self._data.line)

    def has(self, name: str) -> bool:
        """Whether the field's key (or its `KEY_file`) is written in the file, even as null."""
        return self._written_key(name) in self._data

    def written(self, name: str) -> Any:
        """The field's value as written in the file (None when absent), for a rule about
        what was written rather than what was read (an empty list, not one left empty by
        refused items)."""
        return self._data.get(self._written_key(name))

    def problem(self, message: str, *, key: str | None = None) -> None:
        """`where.key: message` on the key's line, or `where: message` on the section's."""
        if key is None:
            self._run.reader.problem(self.line, f"{self.where}: {message}")
        else:
            written = self._written_key(key)
            self._run.reader.problem(self.line_of(key), f"{self.where}.{written}: {message}")

    def problem_at(self, line: int, message: str) -> None:
        """A message exactly as given, on any line (a clash found across sections)."""
        self._run.reader.problem(line, message)

    def within(self, part: object) -> Check:
        """The check of a section built inside this one (a route of the settings, say)."""
        built, found = self._run.checks.get(id(part), (None, None))
        if built is not part or found is None:
            raise ValueError(f"{part!r} is not a section read from this file")
        return found


class _Run:
    """One file being read: its problems, and the check of every section built."""

    def __init__(self, reader: Reader) -> None:
        self.file = reader.file
        self.reader = reader
        # Keyed by id, holding the section too: one dropped with a failed parent stays alive,
        # so its id is never reused by another section of this run.
        self.checks: dict[int, tuple[object, Check]] = {}

    def build(self, cls: type[T], data: LocatedMap, where: str) -> T:
        fields = _plan(cls)
        values: dict[str, Any] = {}
        complete = True
        for f in fields:
            value = self._field(f, data, where)
            if value is _FAILED:
                complete = False
            elif value is not _DERIVED:
                values[f.name] = value
        for f in fields:
            if f.spec.derive is not None and f.name not in values:
                values[f.name] = f.spec.derive(values) if complete else None
        self._unknown_keys(fields, data, where)
        if not complete:
            # The rules across fields still see the fields that could be read, so one refused
            # value does not hide the other problems of the file until it is fixed.
            partial = getattr(cls, "validate_partial", None)
            if partial is not None:
                partial(values, Check(self, data, where, fields))
            return _FAILED  # type: ignore[no-any-return]
        built = cls(**values)
        check = Check(self, data, where, fields)
        self.checks[id(built)] = (built, check)
        if isinstance(built, Validates):
            built.validate(check)
        return built

    def _field(self, f: _Field, data: LocatedMap, where: str) -> Any:
        if f.spec.source == "line":
            return data.line
        if f.spec.source == "file":
            return self.file
        if f.file_key and f.file_key in data:
            return self._from_file(f, data, where)
        line = data.key_lines.get(f.key, data.line)
        raw = data.get(f.key)
        if raw is None:
            if f.required:
                hint = f" ({f.spec.hint})" if f.spec.hint else ""
                also = f" (or {f.file_key})" if f.file_key else ""
                self.reader.problem(line, f"{where}: {f.key}{also} is required{hint}")
                return _FAILED
            return _DERIVED if f.spec.derive else f.default_value()
        if isinstance(raw, Incomplete):
            # What is missing is reported by the reader (unless the command needs no secret),
            # and parsing what is left would only add confusion. A secret stays given, unread.
            if f.spec.secret and not self.reader.secrets:
                self.reader.withhold(raw)
            value = WITHHELD if f.spec.secret else _FAILED
        else:
            value = f.kind.load(self, raw, f.where_in(where), line)
        if value is _FAILED and not f.required:
            # reported; the default stands in while checking on
            return _DERIVED if f.spec.derive else f.default_value()
        return value

    def _from_file(self, f: _Field, data: LocatedMap, where: str) -> Any:
        """The value of `KEY_file`: read from the file it names (not for a command that
        uses no secret, which gets WITHHELD)."""
        key = f.file_key
        assert key is not None
        line = data.key_lines.get(key, data.line)
        failed = _FAILED if f.required else f.default_value()
        if f.key in data:
            self.reader.problem(line, f"{where}: give {f.key} or {key}, not both")
            return failed
        raw = data[key]
        if isinstance(raw, Incomplete):
            return WITHHELD  # reported by the reader
        try:
            path = yamlconf.non_empty_string(raw)
        except ValueError as exc:
            self.reader.problem(line, f"{where}.{key}: {exc}")
            return failed
        if not self.reader.secrets:
            return WITHHELD
        try:
            text = yamlconf.read_secret_file(path)
        except ValueError as exc:
            self.reader.problem(line, f"{where}.{key}: cannot read {path}: {exc}")
            return WITHHELD  # given, but unread: no other rule should take it for absent
        value = f.kind.load(self, text, f"{where}.{key}", line)
        return failed if value is _FAILED else value

    def _unknown_keys(self, fields: tuple[_Field, ...], data: LocatedMap, where: str) -> None:
        known = sorted(
            k for f in fields if f.spec.source == "yaml" for k in (f.key, f.file_key) if k
        )
        for key in data:
            if key not in known:
                close = _closest(key, known)
                guess = f"; did you mean {close!r}?" if close else ""
                self.reader.problem(
                    data.key_lines.get(key, data.line),
                    f"{where}: unknown key {key!r}; known keys: {', '.join(known)}{guess}",
                )


def _closest(word: str, candidates: list[str]) -> str | None:
    """The known key a typo most likely meant: at most two edits away, fewer for short keys."""
    limit = max(1, min(2, len(word) // 3))
    scored = [(_edits(word.lower(), c.lower()), c) for c in candidates]
    best = min(scored, default=None)
    return best[1] if best and best[0] <= limit else None


def _edits(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap two neighbours) that turn `a` into `b`."""
    before: list[int] | None = None
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (ca != cb))
            if before and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], before[j - 2] + 1)
        before, row = row, current
    return row[-1]


def load(cls: type[T], data: LocatedMap, file: str, *, secrets: bool = True) -> T:
    """The settings `cls` from a file's top-level mapping; ConfigError lists every problem.

    Values in which a variable or file could not be expanded (`data.incomplete`) are
    reported, except, with `secrets=False` (a command that uses no secret), those of secret
    fields: these are then WITHHELD, as are values given by `KEY_file`, which is not read.
    """
    run = _Run(Reader(file, data.incomplete, secrets=secrets))
    result = run.build(cls, data, ROOT)
    run.reader.raise_if_any()
    return result


def load_file(
    cls: type[T], path: str, env: Mapping[str, str] | None = None, *, secrets: bool = True
) -> T:
    return load(cls, yamlconf.load_file(path, env, keep_incomplete=True), path, secrets=secrets)


def load_text(
    cls: type[T],
    text: str,
    file: str = "<text>",
    env: Mapping[str, str] | None = None,
    *,
    secrets: bool = True,
) -> T:
    data = yamlconf.load_text(text, file, env, keep_incomplete=True)
    return load(cls, data, file, secrets=secrets)


# ---------------------------------------------------------------------------- describing


def json_schema(cls: type, *, title: str, schema_id: str | None = None) -> dict[str, Any]:
    """The JSON Schema (draft-07) of a file holding `cls`, for editors that check YAML.

    Every scalar also accepts a string holding `${VAR}`, since the file is checked as written,
    before the environment is read.
    """
    root: dict[str, Any] = {"$schema": "http://json-schema.org/draft-07/schema#"}
    if schema_id:
        root["$id"] = schema_id
    root["title"] = title
    return root | _Section(cls).schema()


def reference(cls: type, *, heading: str = "###") -> str:
    """Markdown: one table (key, type, default, description) per section, top first."""
    out: list[str] = []
    seen: dict[type, str] = {}
    _reference_tables(cls, "top level", heading, seen, out)
    return "\n".join(out)


def _reference_tables(
    cls: type, path: str, heading: str, seen: dict[type, str], out: list[str]
) -> None:
    seen[cls] = path
    title = path if path == "top level" else f"`{path}`"
    out += [f"{heading} {title[0].upper()}{title[1:]}", ""]
    if _DOCS.get(cls):
        out += [_DOCS[cls], ""]
    out += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    nested: list[tuple[type, str]] = []
    for f in _plan(cls):
        if f.spec.source != "yaml":
            continue
        child = f.key if path == "top level" else f"{path}.{f.key}"
        part = _section_in(f.kind)
        kind = f.kind.name()
        if part is not None:
            child = f"{child}[]" if isinstance(f.kind, _List) else child
            if part in seen:
                kind = f"{kind}, as `{seen[part]}`"
            else:
                kind = f"{kind}, see `{child}`"
                nested.append((part, child))
                seen[part] = child
        rows = [[f"`{f.key}`", kind, _default_cell(f), f.spec.doc]]
        if f.file_key:
            rows.append([f"`{f.file_key}`", "file path", "", f"A file holding `{f.key}`."])
        for cells in rows:
            out.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells))
            out[-1] += " |"
    out.append("")
    for part, child in nested:
        _reference_tables(part, child, heading, seen, out)


def _section_in(kind: _Kind) -> type | None:
    if isinstance(kind, _Section):
        return kind.cls
    if isinstance(kind, _List | _Map):
        return _section_in(kind.item if isinstance(kind, _List) else kind.value)
    if isinstance(kind, _Either):
        return _section_in(kind.other)
    return None


def _default_cell(f: _Field) -> str:
    if f.required:
        return "required"
    if f.spec.secret:
        return ""
    value = f.default_json()
    if value is None or value == [] or isinstance(value, dict):
        return ""
    if isinstance(value, list):
        return ", ".join(_code(_yaml_text(v)) for v in value)
    return _code(_yaml_text(value))


def _code(text: str) -> str:
    # An empty string is written as YAML would quote it: an empty code span shows nothing.
    return f"`{text}`" if text else '`""`'


def keys(cls: type) -> list[tuple[str, type, str]]:
    """Every key a file holding `cls` may have: (path, section class, key), the path as
    `routes[].cors.allow_origins` (`[]` for the items of a list), `KEY_file` variants too."""
    found: list[tuple[str, type, str]] = []
    _keys(cls, "", found, ())
    return found


def _keys(
    cls: type, path: str, found: list[tuple[str, type, str]], within: tuple[type, ...]
) -> None:
    for f in _plan(cls):
        if f.spec.source != "yaml":
            continue
        child = f"{path}.{f.key}" if path else f.key
        found += [(f"{path}.{k}" if path else k, cls, k) for k in (f.key, f.file_key) if k]
        part = _section_in(f.kind)
        if part is not None and part not in within:  # a section inside itself ends the walk
            inner = f"{child}[]" if isinstance(f.kind, _List) else child
            _keys(part, inner, found, (*within, cls))


def missing_docs(cls: type) -> list[str]:
    """Keys (as `path.key`) declared without a doc string, in this section and below it."""
    missing: list[str] = []
    _missing_docs(cls, "", missing, set())
    return missing


def _missing_docs(cls: type, path: str, missing: list[str], seen: set[type]) -> None:
    seen.add(cls)
    for f in _plan(cls):
        if f.spec.source != "yaml":
            continue
        child = f"{path}.{f.key}" if path else f.key
        if not f.spec.doc.strip():
            missing.append(child)
        part = _section_in(f.kind)
        if part is not None and part not in seen:
            _missing_docs(part, child, missing, seen)


def schema_text(cls: type, *, title: str) -> str:
    """The JSON Schema of `cls` as committed beside the example files (stable, diffable)."""
    import json  # only here: the loader needs no JSON

    return json.dumps(json_schema(cls, title=title), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m portcullis.sections MODULE:CLASS TITLE FILE` writes the JSON Schema of the
    settings class to FILE (for `make schema`)."""
    import importlib
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or ":" not in args[0]:
        print(main.__doc__, file=sys.stderr)
        return 2
    module, _, name = args[0].partition(":")
    cls = getattr(importlib.import_module(module), name)
    # Run as `-m`, this file is `__main__`: the sections were registered with the module
    # the settings imported, so that one describes them.
    kernel = importlib.import_module("portcullis.sections")
    text = kernel.schema_text(cls, title=args[1])
    with open(args[2], "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
