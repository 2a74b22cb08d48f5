"""Gradient layouts for the benchmark: real models' parameter shapes and synthetic ones."""

import json
import math
import os
from importlib import resources

__all__ = ["LAYOUTS", "load_layout"]

#: Built-in layouts: the JSON files shipped in mpigrad/bench/layouts, plus "small".
LAYOUTS = ("resnet50", "bert_base", "gpt2_small", "small")


def _read_json(text, origin):
    data = json.loads(text)
    params = data["params"] if isinstance(data, dict) else data
    shapes = [tuple(p["shape"]) if isinstance(p, dict) else tuple(p) for p in params]
    if isinstance(data, dict):
        for key, got in (("tensors", len(shapes)),
                         ("elements", sum(math.prod(s) for s in shapes))):
            if key in data and data[key] != got:
                raise ValueError(f"{origin}: '{key}' says {data[key]}, the shapes give {got}")
    return shapes


def load_layout(name):
    """Parameter shapes of a built-in layout or of a JSON file of shapes.

    A JSON file is either ``{"params": [{"shape": [...]}, ...]}`` (the format
    of the built-in files) or a plain list of shapes.
    """
    if name == "small":
        return [(256,)] * 1000
    if name in LAYOUTS:
        text = resources.files(__package__).joinpath(f"layouts/{name}.json").read_text()
        return _read_json(text, name)
    if os.path.isfile(name):
        with open(name) as f:
            return _read_json(f.read(), name)
    raise ValueError(f"layout: expecting one of {', '.join(LAYOUTS)} or a JSON file, "
                     f"got {name!r}")
