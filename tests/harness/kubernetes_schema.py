"""Kubernetes manifests checked against the API's own types, as far as they are known here
without a cluster: every field of a core or batch object against the models of the official
Python client (``kubernetes.client``), strictly (an unknown or misspelt field is an error, as
``kubectl apply --validate=strict`` makes it), then built through the client's deserializer,
which refuses a missing required field."""
from __future__ import annotations

import re
from typing import Any

from kubernetes import client


def problems(value: Any, type_name: str, path: str = "") -> list[str]:
    """What in ``value`` does not fit the client's type ``type_name`` (``V1JobTemplateSpec``, ...)."""
    inner = re.fullmatch(r"(?:list|List)\[(.+)\]", type_name)
    if inner:
        if not isinstance(value, list):
            return [f"{path}: a list expected, {type(value).__name__} found"]
        return [p for i, v in enumerate(value) for p in problems(v, inner.group(1), f"{path}[{i}]")]
    inner = re.fullmatch(r"(?:dict|Dict)\((?:str), (.+)\)|(?:dict|Dict)\[str, (.+)\]", type_name)
    if inner:
        if not isinstance(value, dict):
            return [f"{path}: a mapping expected, {type(value).__name__} found"]
        of = inner.group(1) or inner.group(2)
        return [p for k, v in value.items() for p in problems(v, of, f"{path}.{k}")]
    plain = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str}
    if type_name in plain:
        ok = isinstance(value, plain[type_name]) and not (type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{path}: {type_name} expected, {value!r} found"]
    if type_name == "object":  # IntOrString and the like
        return []
    model = getattr(client, type_name)
    if not isinstance(value, dict):
        return [f"{path}: a {type_name} (mapping) expected, {type(value).__name__} found"]
    by_json = {json_key: attribute for attribute, json_key in model.attribute_map.items()}
    found = [f"{path}.{key}: no such field of {type_name}" for key in value if key not in by_json]
    for key, item in value.items():
        if key in by_json:
            found += problems(item, model.openapi_types[by_json[key]], f"{path}.{key}")
    return found


def build(value: dict, type_name: str):
    """The client's object for ``value``; ValueError where a required field is missing."""
    return client.ApiClient()._ApiClient__deserialize(value, type_name)
