"""A griffe extension for the API reference: genspec's docstrings cross-reference in reST roles
(``:class:`~genspec.engine.SpeculativeEngine```), which Markdown would show as written; this shows each as
the code it names (``SpeculativeEngine``)."""
from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


class ReSTRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
