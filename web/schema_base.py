"""The base of every schema here: marshmallow's ``Schema``, loading the fields a body leaves out
without marshmallow's per-field machinery.

Our request schemas declare many optional knobs (55 fields for a chat completion, 21 for sampling
parameters) and a request sets a few. Marshmallow runs each declared field through its loop
(a closure, a call wrapped for errors, ``Field.deserialize``) even when the body has no value for it,
about 2 µs a field here: two thirds of loading a chat line, and the largest share of accepting a
file of them (bench/batch_submit.py). Marshmallow has no option for this, so ``_deserialize``, its
one step that reads the fields (private API, pinned ``marshmallow<5``), is overridden:

- the fields the body has go through marshmallow's own ``_deserialize``, on a copy of the schema
  narrowed to them (``only=``, built once per set of fields present and kept for every instance
  of the class built with the same options);
- a field the body lacks takes what marshmallow would give it: its ``load_default`` (called when
  callable) or nothing, and a required field, or a field class that changes how a missing value is
  read, goes through ``Field.deserialize`` as before;
- the result keeps the declared order of the fields. Errors are the same; their order in the
  error dict may differ (present fields first).

Hooks (``pre_load``, ``validates``, ``validates_schema``, ``post_load``) run in ``load`` around this
step, as before. Anything else marshmallow allows that this does not handle (``many``,
``partial``, ``unknown=INCLUDE``, dotted ``attribute``) takes marshmallow's path whole.
``tests/web/test_schema_base.py`` checks, for every schema our packages define, that a
load gives what marshmallow's own path gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import marshmallow
from marshmallow import INCLUDE, RAISE, ValidationError, missing
from marshmallow.fields import Field

# Narrowed copies kept per schema class and options: a request chooses which of the declared fields it
# sends, so the sets are few in practice but not bounded by us; past this many they are rebuilt.
MAX_NARROWED = 64
_STOCK_DESERIALIZE = marshmallow.Schema._deserialize


class _Narrowed(NamedTuple):
    schema: marshmallow.Schema  # only the fields present
    # What the absent fields load as, by key (the field's attribute, or its name):
    defaults: dict[str, Any]  # a load_default that is a value
    factories: tuple[tuple[str, Callable[[], Any]], ...]  # a load_default to call
    deserialized: tuple[tuple[str, str, Field], ...]  # (data key, key, field): Field.deserialize reads it
    order: tuple[str, ...] | None  # the keys a load can give, declared order; None: nothing absent is added


class _Plan(NamedTuple):
    names_by_data_key: dict[str, str]
    narrowed: dict[frozenset[str], _Narrowed]
    eligible: bool  # False: this schema always takes marshmallow's path


# Plans by schema class and construction options (classes are declared in code: a bounded set).
_PLANS: dict[tuple, _Plan] = {}


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
        if narrowed.order is None:
            return loaded
        loaded.update(narrowed.defaults)
        for key, make in narrowed.factories:
            if (value := make()) is not missing:
                loaded[key] = value
        index = index if self.opts.index_errors else None
        for data_key, key, field in narrowed.deserialized:
            try:
                value = field.deserialize(missing, data_key, data)
            except ValidationError as error:
                error_store.store_error(error.messages, data_key, index=index)
                continue
            if value is not missing:
                loaded[key] = value
        return {key: loaded[key] for key in narrowed.order if key in loaded}

    def _make_plan(self) -> _Plan:
        # Shared by every instance of the class built with the same options: a schema built per
        # request (as marshmallow's examples do) must not rebuild its narrowed copies each time.
        key = (type(self), None if self.only is None else frozenset(self.only), frozenset(self.exclude),
               frozenset(self.load_only), frozenset(self.dump_only), self.unknown)
        plan = _PLANS.get(key)
        if plan is None:
            fields = self.load_fields.items()
            eligible = all("." not in (field.attribute or name) for name, field in fields)
            plan = _PLANS[key] = _Plan({_data_key(name, field): name for name, field in fields}, {}, eligible)
        self._load_plan = plan
        return plan

    def _narrow(self, plan: _Plan, present: frozenset[str]) -> _Narrowed:
        if len(plan.narrowed) >= MAX_NARROWED:
            plan.narrowed.clear()
        # ``only`` in declared order: the narrowed copy loads its fields in the order it is given them.
        only = tuple(name for name in self.load_fields if name in present)
        schema = type(self)(only=only, load_only=self.load_only, dump_only=self.dump_only, unknown=self.unknown)
        defaults, factories, deserialized, order = {}, [], [], []
        for name, field in self.load_fields.items():
            key = field.attribute or name
            if name in present:
                order.append(key)
            elif field.required or not _reads_missing_as_marshmallow_does(field):
                deserialized.append((_data_key(name, field), key, field))
            elif field.load_default is missing:
                continue  # absent and without a default: not in the result
            elif callable(field.load_default):
                factories.append((key, field.load_default))
            else:
                defaults[key] = field.load_default
            order.append(key)
        added = defaults or factories or deserialized
        narrowed = _Narrowed(schema, defaults, tuple(factories), tuple(deserialized), tuple(order) if added else None)
        plan.narrowed[present] = narrowed
        return narrowed


def _data_key(name: str, field: Field) -> str:
    return field.data_key if field.data_key is not None else name


def _reads_missing_as_marshmallow_does(field: Field) -> bool:
    """Whether ``field`` gives an absent value as ``Field.deserialize(missing)`` does (its
    ``load_default``): its class changes neither step."""
    return (type(field).deserialize is Field.deserialize
            and type(field)._validate_missing is Field._validate_missing)
