"""--config for the tools: "name.field=value,..." -> chunk_kda's config={name: Config}.

name is a stage, a fused group or "pipeline"; the Config is the plan's default for the backend that
runs it (kda.plan), with the named fields replaced. Values are Python literals; 0 / 1 for booleans.
"""
from __future__ import annotations

import ast
import dataclasses

from kda import fused


def parse(text: str, plan) -> dict:
  fields: dict[str, dict] = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    key, _, value = item.partition("=")
    name, _, field = key.partition(".")
    if not field or not value:
      raise ValueError(f"--config items are name.field=value, got {item!r}")
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass                                   # a bare word: a string
    fields.setdefault(name, {})[field] = value
  out = {}
  for name, over in fields.items():
    impl = "" if name == "pipeline" else plan.members_select(name) if name in fused.GROUPS else plan.impl(name)
    base = plan.config(name, impl or None) if name != "pipeline" else plan.config("pipeline")
    if base is None:
      raise ValueError(f"--config: {name!r} runs {impl!r}, which takes no config")
    kinds = {f.name: type(getattr(base, f.name)) for f in dataclasses.fields(base)}
    unknown = sorted(set(over) - set(kinds))
    if unknown:
      raise ValueError(f"--config: {type(base).__name__} of {name!r} has no field {unknown}; it has {sorted(kinds)}")
    out[name] = dataclasses.replace(base, **{k: kinds[k](v) if kinds[k] is bool else v for k, v in over.items()})
  return out
