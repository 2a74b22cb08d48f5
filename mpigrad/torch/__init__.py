"""torch integration: the optimizers and the broadcasts of training state.

Imported only by users who ``import mpigrad.torch``; torch stays optional.

    opt = mpigrad.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()))
    mpigrad.torch.broadcast_parameters(model.state_dict(), root=0)
    mpigrad.torch.broadcast_optimizer_state(opt, root=0)

Importing it registers the torch.distributed backend "mpigrad" (backend.py):
``torch.distributed.init_process_group("mpigrad")`` under mpiexec runs DDP,
FSDP2 and torch's collectives on mpigrad.

``DistributedOptimizer`` reduces every gradient as backward finishes it;
``ShardedOptimizer`` steps each rank's shard of the parameters only (ZeRO-2).
Both stand on one wrapper base (wrapper.py); the interface is Horovod's
(``synchronize()``, ``skip_synchronize()``, ``backward_passes_per_step``)
with DDP's ``no_sync()``.
"""

from .backend import register as _register_backend
from .broadcast import broadcast_optimizer_state, broadcast_parameters, parameter_tree
from .distributed import DistributedOptimizer
from .sharded import ShardedOptimizer

_register_backend()         # torch.distributed.init_process_group("mpigrad")

__all__ = ["DistributedOptimizer", "ShardedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "parameter_tree"]
