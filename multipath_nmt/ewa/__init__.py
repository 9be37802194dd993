"""EWA's fairseq side (Huang et al., 2023), beside its plain-PyTorch layer
:mod:`multipath_nmt.modules.ewa`: :mod:`.training`, the weight averaging after every optimizer step
that :mod:`multipath_nmt.fairseq_patches.ewa_trainer` calls from fairseq-train, and
:mod:`.folding`, the trained model folded into a stock fairseq ``transformer`` checkpoint
(``multipath-convert-ewa``)."""
