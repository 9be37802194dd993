"""fairseq models with routed FFNs (WideNet, moe_transformer's MoE, early EWA, routed
ParameterNet): routing statistics bounded to their step with any criterion, activation
checkpointing refused, and inference that does not depend on the batch (issue 18 items 1-3)."""
import gc
import warnings
import weakref

import pytest
import torch
from conftest import TINY_MODEL, USER_DIR

from multipath_nmt.modules.moe import TopKRouter

PLAIN_CRITERION = ["--criterion", "label_smoothed_cross_entropy"]
MOE_CRITERION = ["--criterion", "label_smoothed_cross_entropy_with_moe"]
ROUTED = {
    "WideNet": ["--arch", "widenet_transformer_wmt_en_de"],
    "MoE every 2nd layer": ["--arch", "moe_transformer_wmt_en_de"],
    "early EWA": ["--arch", "ewa_early_transformer_wmt_en_de", "--max-update", "100"],
    "routed ParameterNet": ["--arch", "parameternet_transformer_wmt_en_de",
                            "--parameternet-mode", "routed", "--parameternet-proj", "both"],
}


def parse(data, *flags):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, [
        str(data), *TINY_MODEL, "--encoder-layers", "4", "--share-all-embeddings", "--cpu",
        "--user-dir", str(USER_DIR), "--label-smoothing", "0.1", *flags])


def build(data, *flags):
    from fairseq import tasks

    args = parse(data, *flags)
    task = tasks.setup_task(args)
    task.load_dataset("train")
    return task, task.build_model(args), task.build_criterion(args)


def batch(task, indices):
    dataset = task.dataset("train")
    return dataset.collater([dataset[i] for i in indices])


def pending_stats(model):
    return sum(len(m._pending_stats) for m in model.modules() if isinstance(m, TopKRouter))


def live_tensors():
    gc.collect()
    return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]


def new_live_tensors(before):
    """How many live tensors are not among ``before`` (weak references by id): what the steps
    keep alive, whatever earlier tests left for their caches and collectors to release later."""
    return sum(1 for t in live_tensors() if id(t) not in before or before[id(t)]() is not t)


@pytest.mark.slow
@pytest.mark.parametrize("system", ["WideNet", "MoE every 2nd layer"])
def test_routing_stats_never_outlive_the_step_with_the_plain_criterion(toy_data_bin, system):
    """fairseq's own label_smoothed_cross_entropy never pops the statistics: they are dropped at
    the start of backward (one warning), so memory stays flat over 50 steps (before: one more
    pending statistic per routing call and step, each holding its router's graph)."""
    task, model, criterion = build(toy_data_bin, *ROUTED[system], *PLAIN_CRITERION)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    sample = batch(task, range(8))
    counts, before = [], {id(t): weakref.ref(t) for t in live_tensors()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(50):
            loss, _, _ = criterion(model, sample)
            assert pending_stats(model) > 0  # recorded by this forward
            loss.backward()
            assert pending_stats(model) == 0  # gone by the start of backward
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
            if step in (1, 49):
                counts.append(new_live_tensors(before))
    assert counts[1] == counts[0]
    messages = [str(w.message) for w in caught if "not consumed" in str(w.message)]
    assert messages == ["routing statistics were not consumed by the criterion, so the "
                        "load-balance loss is not trained; use --criterion "
                        "label_smoothed_cross_entropy_with_moe"]


def test_stats_of_a_forward_without_backward_go_at_the_next_forward(toy_data_bin):
    task, model, criterion = build(toy_data_bin, *ROUTED["WideNet"], *PLAIN_CRITERION)
    model.train()
    sample = batch(task, range(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            criterion(model, sample)
            assert pending_stats(model) == 4  # this forward's 4 routing calls, no more


def test_the_moe_criterion_consumes_the_stats_without_warning(toy_data_bin):
    task, model, criterion = build(toy_data_bin, *ROUTED["WideNet"], *MOE_CRITERION)
    model.train()
    sample = batch(task, range(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the unconsumed-statistics warning would fail here
        for _ in range(3):
            loss, _, log = criterion(model, sample)
            assert pending_stats(model) == 0
            loss.backward()
    assert torch.is_tensor(log["moe_dropped"]) and torch.is_tensor(log["moe_load_0"])


@pytest.mark.parametrize("system", ["MoE every 2nd layer", "early EWA", "routed ParameterNet"])
def test_checkpoint_activations_is_refused_with_routed_ffns(toy_data_bin, system):
    with pytest.raises(ValueError, match="--checkpoint-activations is not supported with routed "
                                         "FFNs"):
        build(toy_data_bin, *ROUTED[system], *MOE_CRITERION, "--checkpoint-activations")


def test_checkpoint_activations_still_works_without_a_router(toy_data_bin):
    task, model, criterion = build(toy_data_bin, "--arch", "parameternet_transformer_wmt_en_de",
                                   "--parameternet-mode", "dynamic", *MOE_CRITERION,
                                   "--checkpoint-activations")
    loss, _, _ = criterion(model.train(), batch(task, range(4)))
    loss.backward()
    assert pending_stats(model) == 0


def translate(task, model, indices):
    """Beam search (fairseq's SequenceGenerator) of the given training sentences in one batch:
    {sentence index: (tokens, positional scores)} of the best hypothesis."""
    generator = task.build_generator([model], parse_generation_args())
    sample = batch(task, indices)
    hypotheses = task.inference_step(generator, [model], sample)
    return {int(i): (h[0]["tokens"], h[0]["positional_scores"])
            for i, h in zip(sample["id"], hypotheses)}


def parse_generation_args():
    from argparse import Namespace

    return Namespace(beam=3, max_len_a=0, max_len_b=12, min_len=1, unnormalized=False,
                     lenpen=1.0, unkpen=0.0, temperature=1.0, match_source_len=False,
                     no_repeat_ngram_size=0, sampling=False, sampling_topk=-1,
                     sampling_topp=-1.0, constraints=None, prefix_size=0,
                     diverse_beam_groups=-1, diverse_beam_strength=0.5, diversity_rate=-1.0,
                     print_alignment=None, print_step=False, lm_path=None, lm_weight=0.0,
                     iter_decode_eos_penalty=0.0, iter_decode_max_iter=10,
                     iter_decode_force_max_iter=False, iter_decode_with_beam=1,
                     iter_decode_with_external_reranker=False, retain_iter_history=False,
                     retain_dropout=False, retain_dropout_modules=None, decoding_format=None,
                     no_seed_provided=False, eos_token=None)


def encoder_output(model, task, indices, sentence):
    sample = batch(task, indices)
    net_input = sample["net_input"]
    out = model.encoder(net_input["src_tokens"], net_input["src_lengths"])
    row = sample["id"].tolist().index(sentence)
    keep = ~out["encoder_padding_mask"][0][row]
    return out["encoder_out"][0][:, row][keep]


@pytest.mark.parametrize("system", ["WideNet", "MoE every 2nd layer", "routed ParameterNet"])
def test_a_sentence_translates_alike_alone_and_in_any_batch(toy_data_bin, system):
    """Capacity 0.3 drops many assignments in training; at inference it does not apply unless
    asked, so the translation of sentence 0 is the same alone and in two different batches. With
    --moe-capacity-at-inference the encoder output of sentence 0 changes with its batch."""
    flags = [*ROUTED[system], *MOE_CRITERION, "--moe-capacity-factor", "0.3"]
    torch.manual_seed(1)
    task, model, _ = build(toy_data_bin, *flags)
    model.eval()
    batches = ([0], [0, 1, 2, 3, 4, 5, 6, 7], [0, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])
    with torch.no_grad():
        alone = translate(task, model, batches[0])[0]
        for indices in batches[1:]:
            tokens, scores = translate(task, model, indices)[0]
            assert torch.equal(tokens, alone[0])
            torch.testing.assert_close(scores, alone[1], rtol=1e-5, atol=1e-5)

    torch.manual_seed(1)
    _, with_capacity, _ = build(toy_data_bin, *flags, "--moe-capacity-at-inference")
    with_capacity.eval()
    with torch.no_grad():
        outputs = [encoder_output(with_capacity, task, indices, 0) for indices in batches]
        assert not torch.allclose(outputs[0], outputs[2], atol=1e-4)
        model_outputs = [encoder_output(model, task, indices, 0) for indices in batches]
        torch.testing.assert_close(model_outputs[0], model_outputs[2], rtol=1e-5, atol=1e-5)
