"""What one training micro-batch costs beyond FLOPs: its host syncs and the bytes autograd keeps
for its backward (the probes ``multipath_nmt.host_syncs`` and ``multipath_nmt.saved_tensors``,
which the tests use on their own too)."""
from multipath_nmt.benchmark.kernels import KernelLaunchCounter
from multipath_nmt.host_syncs import HostSyncCounter
from multipath_nmt.modules.moe import pop_all_routing_stats
from multipath_nmt.saved_tensors import SavedForBackward


def micro_batch_profile(trainer, sample):
    """What one micro-batch (``task.train_step``: the criterion's forward, its logging outputs
    and the backward) costs beyond FLOPs: its host syncs (``HostSyncCounter``: the ops that make
    the host wait for a GPU, counted on any device) and the bytes autograd saves for the backward
    (the distinct storages packed by ``saved_tensors_hooks``, parameters excluded)."""
    model, criterion = trainer.model, trainer.criterion
    sample = trainer._prepare_sample(sample)[0]
    with HostSyncCounter() as syncs, SavedForBackward(exclude=model.parameters()) as saved:
        trainer.task.train_step(sample, model, criterion, trainer.optimizer,
                                trainer.get_num_updates())
    model.zero_grad(set_to_none=True)
    pop_all_routing_stats(model)  # forget the routing statistics of this extra pass
    return {"host_syncs": syncs.total, "host_syncs_by_op": dict(syncs.by_op),
            "host_syncs_by_site": dict(syncs.by_site),
            "saved_for_backward_mib": saved.nbytes / 2 ** 20}


def update_profile(update):
    """The host syncs and kernel launches of one whole update (``update()``: fairseq's
    ``Trainer.train_step`` over its micro-batches: forward, loss, backward, gradient norm,
    optimizer step and the trainer's bookkeeping), each counted in an update of its own."""
    with HostSyncCounter() as syncs:
        update()
    with KernelLaunchCounter() as kernels:
        update()
    return {"host_syncs_per_update": syncs.total,
            "host_syncs_per_update_by_site": dict(syncs.by_site),
            "kernel_launches_per_update": kernels.total,
            "kernel_launches_by_op": dict(kernels.by_op.most_common(12))}
