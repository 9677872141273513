"""The base of every schema here: marshmallow's ``Schema``, loading the fields a body leaves out
without marshmallow's per-field machinery.

Our request schemas declare many optional knobs (55 fields for a chat completion, 21 for sampling
parameters) and a request sets a few. Marshmallow runs each declared field through its loop
(a closure, a call wrapped for errors, ``Field.deserialize``) even when the body has no value for it,
about 2 µs a field here: two thirds of loading a chat line, and the largest share of accepting a
file of them (bench/batch_submit.py). Marshmallow has no option for this, so ``_deserialize``, its
one step that reads the fields (private API, pinned ``marshmallow<5``), is overridden:

- the fields the body has go through marshmallow's own ``_deserialize``, on a copy of the schema
  narrowed to them (``only=``, built once per set of fields present and kept);
- a field the body lacks takes what marshmallow would give it: its ``load_default`` (called when
  callable) or nothing, and a required field, or a field class that changes how a missing value is
  read, goes through ``Field.deserialize`` as before;
- the result keeps the declared order of the fields. Errors are the same; their order in the
  error dict may differ (present fields first).

Hooks (``pre_load``, ``validates``, ``validates_schema``, ``post_load``) run in ``load`` around this
step, as before. Anything else marshmallow allows that this does not handle (``many``,
``partial``, ``unknown=INCLUDE``, dotted ``attribute``) takes marshmallow's path whole.
``tests/web/test_schema_base.py`` checks, for every schema in marshmallow's class registry, that a
load gives what marshmallow's own path gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import marshmallow
from marshmallow import INCLUDE, RAISE, ValidationError, missing
from marshmallow.fields import Field

# Narrowed copies kept per schema instance: a request chooses which of the declared fields it
# sends, so the sets are few in practice but not bounded by us; past this many they are rebuilt.
MAX_NARROWED = 64
_STOCK_DESERIALIZE = marshmallow.Schema._deserialize
_DESERIALIZE_ON_MISSING = object()  # an absent field whose value Field.deserialize must give


class _Absent(NamedTuple):
    data_key: str
    key: str  # where the loaded value goes (the field's attribute, or its name)
    field: Field
    default: Any  # the load_default, or _DESERIALIZE_ON_MISSING


class _Narrowed(NamedTuple):
    schema: marshmallow.Schema  # only the fields present
    absent: tuple[_Absent, ...]
    order: tuple[str, ...]  # every loaded key, in declared order


class _Plan(NamedTuple):
    names_by_data_key: dict[str, str]
    narrowed: dict[frozenset[str], _Narrowed]
    eligible: bool  # False: this schema always takes marshmallow's path


class Schema(marshmallow.Schema):
    def _deserialize(self, data, *, error_store, many=False, partial=None, unknown=RAISE, index=None):
        plan = self.__dict__.get("_load_plan") or self._make_plan()
        if many or partial is not None or unknown == INCLUDE or not plan.eligible or not isinstance(data, Mapping):
            return _STOCK_DESERIALIZE(self, data, error_store=error_store, many=many, partial=partial,
                                      unknown=unknown, index=index)
        names = plan.names_by_data_key
        present = frozenset(names[key] for key in data if key in names)
        narrowed = plan.narrowed.get(present) or self._narrow(plan, present)
        loaded = _STOCK_DESERIALIZE(narrowed.schema, data, error_store=error_store, unknown=unknown, index=index)
        if not narrowed.absent:
            return loaded
        index = index if self.opts.index_errors else None
        for absent in narrowed.absent:
            if absent.default is _DESERIALIZE_ON_MISSING:
                try:
                    value = absent.field.deserialize(missing, absent.data_key, data)
                except ValidationError as error:
                    error_store.store_error(error.messages, absent.data_key, index=index)
                    continue
            else:
                value = absent.default() if callable(absent.default) else absent.default
            if value is not missing:
                loaded[absent.key] = value
        return {key: loaded[key] for key in narrowed.order if key in loaded}

    def _make_plan(self) -> _Plan:
        fields = self.load_fields.items()
        eligible = all("." not in (field.attribute or name) for name, field in fields)
        plan = _Plan({_data_key(name, field): name for name, field in fields}, {}, eligible)
        self._load_plan = plan
        return plan

    def _narrow(self, plan: _Plan, present: frozenset[str]) -> _Narrowed:
        if len(plan.narrowed) >= MAX_NARROWED:
            plan.narrowed.clear()
        # ``only`` in declared order: the narrowed copy loads its fields in the order it is given them.
        only = tuple(name for name in self.load_fields if name in present)
        schema = type(self)(only=only, load_only=self.load_only, dump_only=self.dump_only, unknown=self.unknown)
        absent = tuple(_Absent(_data_key(name, field), field.attribute or name, field, _absent_default(field))
                       for name, field in self.load_fields.items() if name not in present)
        order = tuple(field.attribute or name for name, field in self.load_fields.items())
        narrowed = plan.narrowed[present] = _Narrowed(schema, absent, order)
        return narrowed


def _data_key(name: str, field: Field) -> str:
    return field.data_key if field.data_key is not None else name


def _absent_default(field: Field) -> Any:
    """What an absent ``field`` loads as, as ``Field.deserialize(missing)`` gives it."""
    stock = (type(field).deserialize is Field.deserialize
             and type(field)._validate_missing is Field._validate_missing)
    return field.load_default if stock and not field.required else _DESERIALIZE_ON_MISSING
