"""mpigrad's hook in torch's backend autoload (the entry point group
"torch.backends", run by ``import torch``): ``init_process_group("mpigrad")``
works, or names its fix, in a program that never imported ``mpigrad.torch``.

- The backend "mpigrad" is registered by name; its groups are made by
  ``mpigrad.torch.backend.create``, imported only when torch asks for one.
- torch's ``env://`` rendezvous, which needs RANK and WORLD_SIZE unless
  ``mpigrad.torch`` takes them from MPI, adds the fix to its error where they
  are missing: ``import mpigrad.torch`` (every other outcome is torch's own).

Light and harmless by design: nothing of mpigrad, mpi4py or MPI is imported
here, and torch's import never fails because of it (any error leaves torch as
it was). ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns every such hook off.
"""

import importlib
from typing import Any, Iterator

NAME = "mpigrad"

_FIX = (f"; with the '{NAME}' backend, `import mpigrad.torch` before init_process_group: it "
        "takes the ranks from MPI (launch with `mpiexec -n N python script.py`)")


def _create(options: Any, backend_options: Any) -> Any:
    """torch's creator of a group on the backend: mpigrad's, imported now."""
    backend = importlib.import_module("mpigrad.torch.backend")
    backend.register()
    return backend.create(options, backend_options)


def register() -> None:
    """The entry point: register the backend by name and the rendezvous's fix."""
    try:
        import torch.distributed as dist
        if not dist.is_available():
            return
        if NAME not in dist.Backend.backend_list:
            dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
        handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
        env = handlers.get("env")
        if env is not None and not getattr(env, "names_the_fix", False):
            handlers["env"] = _naming_the_fix(env)
    except Exception:       # noqa: BLE001 - never in the way of torch's import
        pass


def _naming_the_fix(env: Any) -> Any:
    """torch's env:// handler ``env``, its missing-variable error naming the fix."""
    def rendezvous(url: str, **kwargs: Any) -> Iterator[Any]:
        try:
            yield from env(url, **kwargs)
        except ValueError as exc:
            if "expected, but not set" not in str(exc):
                raise
            raise ValueError(f"{exc}{_FIX}") from exc
    rendezvous.names_the_fix = True     # type: ignore[attr-defined]
    return rendezvous
