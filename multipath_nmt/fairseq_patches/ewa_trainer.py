"""Run the EWA weight averaging after every real optimizer step of ``fairseq-train``.

fairseq has no after-step hook for models, so ``Trainer.set_num_updates`` (called once after each
successful optimizer step, and also when a checkpoint is loaded) is wrapped to call
:func:`multipath_nmt.ewa.training.after_step`, and ``Trainer.train_step`` to tell the two apart:
only a count advanced by one inside ``train_step`` is an optimizer step.

Reach beyond the plug-in's own models: every ``Trainer`` sets a flag around ``train_step`` and looks
for EWA modules after each update.
Does nothing when: the model has no EWA layer.
"""
import functools

from multipath_nmt.ewa.training import after_step
from multipath_nmt.fairseq_patches.wrapping import wrap


def _flagging_train_step(train_step):
    @functools.wraps(train_step)
    def train_step_flagged_for_ewa(self, *args, **kwargs):
        self._ewa_in_train_step = True
        try:
            return train_step(self, *args, **kwargs)
        finally:
            self._ewa_in_train_step = False

    return train_step_flagged_for_ewa


def _averaging_after_step(set_num_updates):
    @functools.wraps(set_num_updates)
    def set_num_updates_then_average(self, num_updates):
        previous = self.get_num_updates()
        set_num_updates(self, num_updates)
        # load_checkpoint also sets the count (0 -> N on resume): only a step inside train_step
        # that advances the count by one is an optimizer step
        if getattr(self, "_ewa_in_train_step", False) and num_updates == previous + 1:
            after_step(self.model, self.optimizer, num_updates)

    return set_num_updates_then_average


def install():
    from fairseq.trainer import Trainer

    wrap(Trainer, "train_step", _flagging_train_step)
    wrap(Trainer, "set_num_updates", _averaging_after_step)
