"""Every change the plug-in makes to fairseq 0.12, PyTorch and Python at import time, in one place.

:func:`install` (called by ``multipath_nmt/__init__.py``, so by every ``--user-dir multipath_nmt``
run) puts them all in place; calling it again changes nothing. Each patch is a
``make_wrapper(original)`` put in place by :func:`multipath_nmt.fairseq_patches.wrapping.wrap`,
which marks the wrapper with the patch's name and skips a patch already there. Before any of them,
:func:`install` refuses in one line a fairseq the patches are not tested on
(:data:`~multipath_nmt.fairseq_patches.wrapping.KNOWN_FAIRSEQ`) and an attribute a patch would
wrap that is missing or not callable (:mod:`multipath_nmt.fairseq_patches.wrapping` says how).
The code a patch calls, when it is more than the wiring, is library code outside this package
(:mod:`multipath_nmt.checkpoint_io`, :mod:`multipath_nmt.ewa.training`,
:mod:`multipath_nmt.atomic_files`).

``MULTIPATH_NMT_PATCHES=off`` in the environment installs none of them (:data:`SWITCH`): fairseq
as it ships, for debugging and for measuring stock fairseq; the models still register.
``MULTIPATH_NMT_PATCHES=-attention,-preemption`` leaves out just those modules (names from the
table below, :data:`NAMES`), to debug one patch with the others in place. With ``off``, as in
stock fairseq 0.12: on torch >= 2.6 no fairseq checkpoint loads (resume, ``fairseq-generate``);
``--amp`` takes steps of the wrong size, resumes at the initial loss scale, ignores
``--amp-init-scale`` and ``--amp-scale-window`` and retries fewer overflowing batches as the run
goes on, ``--amp --bf16`` casts the weights; ``--bf16`` asks for a TPU; EWA models never average;
the last batch of each pass is dropped; a resume after epoch 1 trains on other batches; signals
kill the run without a save; ``torchrun`` on CPUs fails; errors are tracebacks, found mid-epoch;
``--help`` lists no model flags; attention takes fairseq's masked path.

Tested with fairseq-fixed 0.12.3.1 (fairseq main of January 2024; README, "Which fairseq") and torch 2.13. "fairseq 0.12" below means the 0.12 series (the last
release); "any" means every torch that pyproject.toml allows (>= 2.1).

================  ==========================================================  ===================================================  ============  =================================================================================================
Module            What is patched                                             Why                                                  Needed on     Proved by
================  ==========================================================  ===================================================  ============  =================================================================================================
torch_compat      ``torch.serialization`` safe globals                        fairseq checkpoints pickle ``argparse.Namespace``,   torch >= 2.6  tests/test_compat.py::test_namespace_is_allowed_and_nothing_more
                                                                              refused by ``weights_only=True`` loading                           tests/test_compat.py::test_train_resume_and_generate_without_environment
                  ``distributed.utils._broadcast_object_slow``                a distributed resume sends rank 0's OmegaConf state  torch >= 2.6  tests/test_distributed.py::test_killed_two_rank_ewa_run_resumes_like_one_process
                                                                              through ``torch.load``
help_flags        ``options.parse_args_and_arch``                             ``--help`` printed before the model's flags existed  fairseq 0.12  tests/test_help.py::test_help_lists_the_architectures_flags_with_help_and_default
batching          ``data_utils.batch_by_size``                                the last batch was dropped (fairseq issue #5036)     fairseq 0.12  tests/test_compat.py::test_batching_keeps_every_sentence
                                                                                                                                                 tests/test_compat.py::test_generate_translates_every_test_sentence
                  ``FairseqTask.get_batch_iterator``                          a run resumed in epoch e >= 2 built other batches    fairseq 0.12  tests/test_checkpoints.py::test_batches_of_a_later_epoch_are_those_of_epoch_1
                                                                              than an uninterrupted one                                          tests/test_crash_resume.py::test_sigkill_in_epoch_2_then_same_command_resumes_bit_exactly
                  ``EpochBatchIterator.state_dict``,                          a resume on another number of processes trained      fairseq 0.12  tests/test_launcher.py::test_a_resume_on_another_number_of_ranks_trains_each_sentence_of_the_epoch_once
                  ``EpochBatchIterator.load_state_dict``,                     part of the epoch twice or skipped it (the saved
                  ``EpochBatchIterator.ordered_batches``                      position counted one process's batches)
checkpoints       ``checkpoint_utils.load_checkpoint_to_cpu``                 one true line for each way a checkpoint fails        fairseq 0.12  tests/test_checkpoints.py::test_reader_tells_each_failure_apart
                                                                                                                                                 tests/test_checkpoints.py::test_fairseq_generate_says_one_line
                  ``checkpoint_utils.torch_persistent_save``                  a full disk left a ``.tmp`` file and a traceback;    fairseq 0.12  tests/test_checkpoints.py::test_full_disk_during_a_save
                                                                              ``--write-checkpoints-asynchronously`` saved         torch 2.13    tests/test_checkpoints.py::test_asynchronous_writes_save_the_synchronous_checkpoints
                                                                              unreadable files (torch.save into ioPath's
                                                                              unseekable file)
                  ``PathManager.copy``                                        ``checkpoint_last.pt`` was copied in place: a kill   fairseq 0.12  tests/test_compat.py::test_atomic_copy_leaves_no_partial_file
                                                                              left it unloadable                                                 tests/test_crash_resume.py::test_sigkill_during_checkpoint_copy_leaves_a_loadable_checkpoint_last
                  ``checkpoint_utils.load_checkpoint``                        a damaged ``checkpoint_last.pt`` stopped the resume  fairseq 0.12  tests/test_checkpoints.py::test_resume_sets_a_damaged_checkpoint_last_aside
                                                                              (asked through fairseq's ``PathManager``; what is                  tests/test_checkpoints.py::test_resume_with_nothing_readable_starts_over
                                                                              not proven damaged goes to fairseq unchanged)                      tests/test_fairseq_compat_suite.py::test_resume_decides_through_pathmanager_and_restores_the_iterator
                                                                                                                                                 tests/test_fairseq_compat_suite.py::test_finetune_from_model_with_a_checkpoint_last_resumes_it
                  ``Trainer.load_checkpoint``,                                a mismatched dictionary failed later on a tensor     fairseq 0.12  tests/test_checkpoints.py::test_mismatched_dictionary_generate_and_resume
                  ``checkpoint_utils.load_model_ensemble_and_task``           shape; a same-size dictionary with other                           tests/test_checkpoints.py::test_same_size_dictionary_with_other_symbols_generate_and_resume
                                                                              symbols loaded silently
                  ``Trainer.load_checkpoint``                                 a resume with another ``--arch``, ``--criterion``    fairseq 0.12  tests/test_checkpoints.py::test_a_resume_with_another_arch_criterion_or_optimizer_says_what_differs
                                                                              or ``--optimizer`` ended in chained tracebacks;
                                                                              one line: what differs, which flag accepts it
                  ``Trainer.state_dict``                                      records the dictionaries' symbols for that check     fairseq 0.12  tests/test_checkpoints.py::test_same_size_dictionary_with_other_symbols_generate_and_resume
                  ``sys.excepthook``                                          an uncaught ``CheckpointError`` is one line, no      any           tests/test_checkpoints.py::test_console_scripts_say_one_line
                                                                              traceback
data_bins         ``TranslationTask.setup_task``                              a missing or malformed ``dict.<lang>.txt`` was a     fairseq 0.12  tests/test_data_checks.py::test_fairseq_train_says_one_line_before_the_first_update
                                                                              traceback; checked as fairseq reads it, one line                   tests/test_data_checks.py::test_fairseq_generate_says_one_line
                  ``TranslationTask.load_dataset``                            a damaged data-bin (``.idx``/``.bin``, counts, ids   fairseq 0.12  tests/test_data_checks.py::test_fairseq_train_says_one_line_before_the_first_update
                                                                              past the dictionary) failed mid-epoch with a                       tests/test_data_checks.py::test_fairseq_generate_says_one_line
                                                                              traceback; checked before the first update                         tests/test_data_checks.py::test_check_split_tells_each_damage_apart
                  ``sys.excepthook``                                          an uncaught ``DataBinError`` is one line, no         any           tests/test_data_checks.py::test_fairseq_generate_says_one_line
                                                                              traceback
distributed       ``distributed.utils._infer_torch_distributed_launch_init``  ``torchrun`` without CUDA: ZeroDivisionError in      fairseq 0.12  tests/test_distributed.py::test_two_ranks_match_one_process_with_update_freq_two
                                                                              fairseq's device choice
                  ``distributed_fairseq_model.DistributedDataParallel``       torch's DDP refuses ``device_ids`` for CPU modules   any           tests/test_distributed.py::test_two_ranks_match_one_process_with_update_freq_two
                  ``distributed.utils.distributed_main``                      the process group was never destroyed: gloo's        fairseq 0.12  tests/test_distributed.py::test_a_rank_that_finished_destroys_its_process_group_and_one_that_failed_leaves_it
                                                                              threads, torn down at exit, now and then aborted a
                                                                              finished run (exit 134)
numerics          ``Trainer.train_step``                                      a NaN/Inf did not say its update; fairseq's          torch >= 2.0  tests/test_numerics.py::test_nan_loss_stops_training_with_the_update_number
                                                                              NanDetector re-run died with ``StopIteration``; a                  tests/test_numerics.py::test_fp16_nan_loss_stops_training_with_the_update_number
                                                                              CPU fp16 overflow crashed                                          tests/test_numerics.py::test_cpu_fp16_overflow_skips_the_update_instead_of_crashing
                  ``Trainer.__init__``                                        ``--fp16`` without CUDA died deep inside fairseq     fairseq 0.12  tests/test_numerics.py::test_fp16_without_cuda_is_refused_with_a_clear_message
out_of_memory     ``Trainer.train_step``                                      an out-of-memory micro-batch dropped its update      fairseq 0.12  tests/test_out_of_memory.py::test_out_of_memory_in_a_micro_batch_stops_in_one_line
                                                                              silently (every epoch; a hang on several ranks);                   tests/test_out_of_memory.py::test_out_of_memory_in_the_optimizer_step_stops_in_one_line
                                                                              now one line naming it and ``--max-tokens``                        tests/test_out_of_memory.py::test_out_of_memory_on_one_of_two_ranks_stops_both
                  ``Trainer._prepare_sample``,                                count the micro-batches and mark their end,          fairseq 0.12  tests/test_out_of_memory.py::test_out_of_memory_in_a_micro_batch_stops_in_one_line
                  ``Trainer._sync_stats``                                     for that line
                  ``sys.excepthook``                                          an uncaught ``OutOfMemoryInUpdateError`` is one      any           tests/test_out_of_memory.py::test_out_of_memory_in_a_micro_batch_stops_in_one_line
                                                                              line, no traceback
mixed_precision   ``AMPOptimizer.step``                                       ``--amp`` unscaled every gradient twice              fairseq 0.12  tests/test_mixed_precision.py::test_amp_update_is_fp32_adams
                  ``AMPOptimizer.__init__``                                   ``--amp --bf16``: no loss scaler, bf16 autocast;     fairseq 0.12  tests/test_mixed_precision.py::test_amp_bf16_has_no_loss_scaler_and_records_its_dtype
                                                                              the scaler ignored ``--amp-init-scale`` and took                   tests/test_mixed_precision.py::test_amp_loss_scaler_takes_the_amp_flags
                                                                              ``--amp-scale-window`` from ``--amp-init-scale``
                  ``Trainer.train_step``                                      ``--amp`` cast every weight again in every           fairseq 0.12  tests/test_mixed_precision.py::test_bf16_autocast_casts_the_weights_once_per_update
                                                                              micro-batch of an update
                  ``Trainer.set_num_updates``                                 ``--amp-batch-retries`` counted over the whole run,  fairseq 0.12  tests/test_mixed_precision.py::test_amp_batch_retries_are_a_budget_per_batch
                                                                              not per batch
                  ``options.parse_args_and_arch``                             ``--bf16`` implied ``--tpu`` without torch_xla       fairseq 0.12  tests/test_mixed_precision.py::test_bf16_means_a_tpu_only_where_torch_xla_is_installed
                  ``Trainer.__init__``                                        ``--amp --bf16`` cast the weights to bf16            fairseq 0.12  tests/test_mixed_precision.py::test_fairseq_train_in_bf16_on_the_cpu
                  ``FairseqTask.train_step``                                  ``--amp`` autocast only CUDA, only to float16        fairseq 0.12  tests/test_mixed_precision.py::test_amp_bf16_runs_the_criterion_under_bf16_autocast_with_fp32_weights
                  ``CheckpointFunction.forward``                              activation checkpointing recomputed outside the      fairseq 0.12  tests/test_mixed_precision.py::test_checkpointed_layers_recompute_under_the_forward_autocast
                                                                              forward's autocast
                  ``AMPOptimizer.clip_grad_norm``                             a NaN/Inf gradient under ``--amp --bf16`` (no        fairseq 0.12  tests/test_mixed_precision.py::test_amp_without_a_scaler_stops_at_a_non_finite_gradient_as_fp32_does
                                                                              scaler) died with an AttributeError; now fp32's                    tests/test_mixed_precision.py::test_amp_without_a_scaler_steps_on_finite_gradients_as_fp32_does
                                                                              error, before any step                                             tests/test_mixed_precision.py::test_fairseq_train_amp_bf16_stops_at_a_non_finite_gradient_as_fp32_does
                  ``AMPOptimizer.state_dict``,                                ``--amp``'s loss scaler state was not saved: a       fairseq 0.12  tests/test_mixed_precision.py::test_amp_optimizer_state_holds_the_loss_scaler_state
                  ``AMPOptimizer.load_state_dict``                            resume restarted at the initial scale (128)                        tests/test_mixed_precision.py::test_a_checkpoint_without_the_scaler_state_loads_with_fairseqs_initial_scale
                                                                                                                                                 tests/test_mixed_precision.py::test_fp16_amp_resume_keeps_the_loss_scale_and_is_bit_exact
grad_norm         ``utils.multi_tensor_total_norm``                           without apex, one norm kernel per parameter at       fairseq 0.12  tests/test_grad_norm.py::test_the_norm_and_the_clipped_gradients_are_fairseqs
                  (and ``utils.multi_tensor_l2norm_available``)               every update; now ``torch._foreach_norm``                          tests/test_grad_norm.py::test_one_update_launches_a_few_norm_kernels_not_one_per_parameter
attention         ``MultiheadAttention.forward``                              mask tensors ruled out flash attention in the        torch >= 2.0  tests/test_attention.py::test_causal_self_attention_is_exact_at_every_unpadded_position
                                                                              decoder; cross-attention skipped SDPA. Under                       tests/test_attention.py::test_encoder_decoder_attention_takes_the_sdpa_path_with_fairseqs_numbers
                                                                              TorchScript: fairseq's forward (on the class as                    tests/test_fairseq_compat_suite.py::test_transformer_scripts_as_fairseqs_and_computes_the_same
                                                                              ``fairseq_forward``)                                               tests/test_fairseq_compat_suite.py::test_sequence_generator_and_ensemble_script_and_translate_as_eager
                  ``TransformerModelBase.build_model``                        marks the decoder attentions (and the padding side)  fairseq 0.12  tests/test_attention.py::test_left_padded_targets_keep_the_masks
                                                                              for the ``forward`` above; others stay fairseq's                   tests/test_attention.py::test_mask_passed_to_sdpa_per_call_site
                                                                                                                                                 tests/test_fairseq_compat_suite.py::test_decoder_built_outside_build_model_computes_fairseqs_numbers
ewa_trainer       ``Trainer.train_step``,                                     EWA averages after every optimizer step; fairseq     fairseq 0.12  tests/test_ewa.py::test_hook_runs_only_on_real_steps
                  ``Trainer.set_num_updates``                                 has no after-step hook                                             tests/test_ewa.py::test_fairseq_train_averages_after_every_update_in_half_precision
preemption        ``fairseq_cli.train.train``                                 SIGTERM/SIGUSR1 killed the run, SIGINT gave a        fairseq 0.12  tests/test_preemption.py::test_sigusr1_and_sigint_stop_the_same_way
                                                                              traceback, and nothing was saved: handlers record
                                                                              the signal
                  ``fairseq_cli.train.validate_and_save``                     after the update in flight, all ranks agree, save    fairseq 0.12  tests/test_preemption.py::test_sigterm_at_a_random_update_then_resume_is_bit_exact
                                                                              ``checkpoint_last.pt`` with the iterator position                  tests/test_preemption.py::test_two_ranks_stop_after_the_same_update_when_one_is_signalled
                                                                              and exit with 128 + the signal's number                            tests/test_preemption.py::test_signals_during_the_save_change_nothing
                                                                                                                                                 tests/test_preemption.py::test_asynchronous_writes_are_awaited_before_the_exit
                  ``checkpoint_utils.save_checkpoint``                        records the last update saved, so that a stop does   fairseq 0.12  tests/test_preemption.py::test_two_ranks_stop_after_the_same_update_when_one_is_signalled
                                                                              not save the same update twice
                  ``Trainer.train_step``,                                     the ranks' stop flag rides in fairseq's all-reduce   fairseq 0.12  tests/test_preemption.py::test_the_stop_decision_adds_no_host_sync_per_update
                  ``Trainer._aggregate_logging_outputs``                      of the update's statistics: no collective, copy or
                                                                              read of its own per update
compile_layers    ``options.add_optimization_args``                           ``--compile-layers [BACKEND]``: fairseq 0.12         fairseq 0.12  tests/test_compile.py::test_fairseq_train_compiled_matches_eager_and_saves_eager_keys
                                                                              predates ``torch.compile``; a training flag                        tests/test_compile.py::test_compile_flag_refuses_bad_input_in_one_line
                  ``Trainer.__init__``                                        compiles the encoder and decoder layers' training    torch >= 2.1  tests/test_compile.py::test_every_family_compiles_without_graph_breaks_or_recompiles
                                                                              forward in place, after the model is built                         tests/test_compile.py::test_only_the_training_forward_is_compiled
save_dirs         ``fairseq_cli.train.main``                                  a second run on a live ``--save-dir`` resumed from   fairseq 0.12  tests/test_checkpoints.py::test_a_second_run_on_a_live_save_dir_is_refused
                                                                              its ``checkpoint_last.pt`` and both overwrote it:                  tests/test_defaults_locks.py::test_fairseq_train_on_a_save_dir_it_cannot_write_says_one_line
                                                                              rank 0 now holds a lock on the save dir; one it                    tests/test_defaults_locks.py::test_a_refused_train_sh_leaves_the_first_run_able_to_resume
                                                                              cannot write was a traceback; rank 0 writes
                                                                              train.sh's batch record once it holds the lock
                  ``sys.excepthook``                                          an uncaught ``SaveDirInUseError`` or                 any           tests/test_checkpoints.py::test_a_second_run_on_a_live_save_dir_is_refused
                                                                              ``SaveDirError`` is one line, no traceback
================  ==========================================================  ===================================================  ============  =================================================================================================

Order: the modules are installed in the order of :data:`MODULES`. ``Trainer.__init__`` is wrapped
by numerics, then mixed_precision, then compile_layers (outermost: it compiles the layers of the
model the others' ``__init__`` has placed and cast), and ``options.parse_args_and_arch`` by
help_flags, then mixed_precision, and ``Trainer.set_num_updates`` by mixed_precision, then
ewa_trainer; the wrappers of each group look at different flags. ``sys.excepthook`` by
checkpoints, then data_bins, then out_of_memory, then save_dirs (each prints its own error class
on one line and passes anything else on). ``Trainer.train_step`` is
wrapped five times: numerics first (inner), then out_of_memory (it passes fairseq's
``raise_oom=True`` and turns the out-of-memory error that numerics lets pass into its one line),
then mixed_precision, then ewa_trainer, then preemption (outer: it only
marks that a ``train_step`` is running, for its ``_aggregate_logging_outputs`` wrapper). Any order
gives the same training (the EWA and preemption flags only have to be set while fairseq's
``train_step`` runs, and are cleared in a ``finally`` whatever numerics raises or skips); the order
is fixed so that every process and every traceback has the same stack.
``tests/test_fairseq_patches.py`` checks the order, that a second :func:`install` wraps nothing
again, and that every test named above exists.

fairseq's own test suite, run plain and with these patches installed
(``scripts/fairseq-tests.sh``, ``docs/fairseq-tests.md``), has no test that passes only
without them; ``tests/test_fairseq_compat_suite.py`` keeps the cases that once did.
"""
import logging
import os
import sys

from multipath_nmt.fairseq_patches import (attention, batching, checkpoints, compile_layers,
                                           data_bins, distributed, ewa_trainer, grad_norm,
                                           help_flags, mixed_precision, numerics, out_of_memory,
                                           preemption, save_dirs, torch_compat)
from multipath_nmt.fairseq_patches.wrapping import (SWITCH, PatchRefusedError, one_line_refusals,
                                                    planning, refuse_untested_fairseq, wrap)

MODULES = (torch_compat, help_flags, batching, checkpoints, data_bins, distributed, numerics,
           out_of_memory, mixed_precision, grad_norm, attention, ewa_trainer, preemption,
           compile_layers, save_dirs)


NAMES = tuple(module.__name__.rsplit(".", 1)[1] for module in MODULES)

# SWITCH, ``MULTIPATH_NMT_PATCHES`` (defined in wrapping, whose refusals name it): ``off``
# installs none of the patches: fairseq runs as it ships, for debugging and for measuring stock
# fairseq. The models still register; what the patches fix is broken again (on torch >= 2.6 no
# checkpoint loads, --amp unscales twice, ...).
# ``-NAME,-NAME`` leaves out only those modules: someone chasing one patch keeps the others (a
# checkpoint still loads while the attention patch is off). Only exclusions are offered: every
# patch is on unless named, so a new patch module is never silently left out.


def left_out():
    """The names (:data:`NAMES`) of the modules ``MULTIPATH_NMT_PATCHES`` turns off: all for
    ``off``, none for ``on`` (the default); a malformed value or unknown name raises one line."""
    value = os.environ.get(SWITCH, "on").strip()
    if value == "on":
        return ()
    if value == "off":
        return NAMES
    entries = [entry.strip() for entry in value.split(",")]
    if not all(entry.startswith("-") for entry in entries):
        raise ValueError(f"{SWITCH} must be 'on' or 'off', got {value!r}; or -NAME,-NAME to leave "
                         f"out some patches, NAME one of {', '.join(NAMES)}")
    names = [entry[1:].strip() for entry in entries]
    unknown = [name for name in names if name not in NAMES]
    if unknown:
        raise ValueError(f"{SWITCH}={value}: unknown patch {', '.join(map(repr, unknown))}; "
                         f"known patches: {', '.join(NAMES)}")
    return tuple(name for name in NAMES if name in names)


def enabled():
    """Whether any patch is to be installed (``MULTIPATH_NMT_PATCHES`` is not ``off``)."""
    return len(left_out()) < len(NAMES)


def running_a_fairseq_command():
    """Whether this process is one of fairseq's commands: ``fairseq-train`` and the other console
    scripts, or ``python -m fairseq_cli.train`` (torchrun's workers, train.sh)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = spec.name if spec is not None else os.path.basename(sys.argv[0] if sys.argv else "")
    return program.startswith(("fairseq_cli.", "fairseq-"))


def install():
    """Put every patch in place (idempotent), but those ``MULTIPATH_NMT_PATCHES`` turns off.

    Before the first wrap: the fairseq of this process must be one the patches are tested on, and
    every attribute they wrap must be there and callable; else :class:`PatchRefusedError`, one
    line in a command-line tool (the hook that prints it goes in just before it is raised)."""
    skipped = left_out()
    logger = logging.getLogger(__name__)
    in_force = [name for name in NAMES if name not in skipped]
    modules = [module for name, module in zip(NAMES, MODULES) if name in in_force]
    if modules:
        try:
            refuse_untested_fairseq(in_force, len(NAMES))
            with planning():  # every wrap checks its target; nothing is replaced yet
                for module in modules:
                    module.install()
        except PatchRefusedError:
            wrap(sys, "excepthook", one_line_refusals)
            raise
    if len(skipped) == len(NAMES):
        logger.warning("%s=off: fairseq runs without the plug-in's patches", SWITCH)
    elif skipped:
        logger.warning("%s=%s: fairseq runs without the plug-in's patches %s", SWITCH,
                       os.environ[SWITCH].strip(), ", ".join(skipped))
    # at the start of a fairseq-train log, which the run's numbers depend on (docs/patches.md);
    # our own tools print nothing of it (fairseq's speech modules turn INFO on at import)
    logger.log(logging.INFO if running_a_fairseq_command() else logging.DEBUG,
               "patches in force: %s (%s switches them)", ", ".join(in_force) or "none", SWITCH)
    for module in modules:
        module.install()
