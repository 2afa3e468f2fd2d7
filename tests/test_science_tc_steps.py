"""Tc training steps (`flashmoe_science.science.tc`): the padded batch a graphed step runs, and
CUDA-graph steps against eager ones. Compounds are built from atomic numbers and the element
table is random: neither pymatgen nor matminer is needed (the GPU image has neither)."""
import random

import pytest
import torch

from flashmoe_science.science import tc


def compounds(n, seed=0):
    """n compounds of 1 to 6 elements with random fractions, and a Tc that depends on them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        elements = rng.sample(range(1, tc.MAX_Z + 1), rng.randint(1, 6))
        amounts = [rng.uniform(0.1, 3.0) for _ in elements]
        fractions = [a / sum(amounts) for a in amounts]
        out.append(tc.Compound(f"c{i}", elements, fractions, tc=sum(z * f for z, f in zip(elements, fractions))))
    return out


def element_table(properties=6):
    return torch.randn(tc.MAX_Z + 1, properties, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_a_padded_batch_predicts_its_compounds_as_the_batch_does(backend, device):
    batch = compounds(5)
    torch.manual_seed(0)
    model = tc.TcSetTransformer(element_table(), dim=32, heads=2, depth=2, experts=4, expert_dim=16,
                                backend=backend).to(device)
    z, frac, cu, longest, _ = tc.pack(batch, device)
    tokens = z.numel()
    for pad_to in (tokens + 1, tokens + 7):
        padded = [t.to(device) for t in tc._host_batch(batch, pad_to=pad_to)]
        assert padded[0].numel() == pad_to and padded[2].tolist()[:-1] == cu.tolist() and len(padded[3]) == 5
        torch.testing.assert_close(model(*padded[:3], max(longest, pad_to - tokens))[:5], model(z, frac, cu, longest),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pad_to"):
        tc._host_batch(batch, pad_to=tokens)


def test_cuda_graphs_are_refused_where_a_step_cannot_be_captured():
    for backend, device in (("torch", "cuda"), ("kernels", "cpu")):
        with pytest.raises(ValueError, match="cuda_graphs needs the kernels backend on a CUDA device"):
            tc.train_model(compounds(4), element_table(), device, epochs=1, backend=backend, cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("stats", [False, True], ids=["tokens", "composition_stats"])
def test_graphed_training_steps_are_the_eager_steps(stats):
    data = compounds(96)
    options = dict(dim=32, heads=2, depth=2, experts=4, expert_dim=16, composition_stats=stats)
    # Batches of 32 compounds (about 112 tokens: padded to 128 or 256), 6 epochs: each token
    # count's first batch eager, its second captured, later ones replayed, between the others.
    runs = [tc.train_model(data, element_table(), "cuda", epochs=6, batch_size=32, cuda_graphs=graphs,
                           model_options=options) for graphs in (False, True)]
    torch.testing.assert_close(runs[1].losses, runs[0].losses, atol=1e-4, rtol=1e-3)
    for (name, eager), graphed in zip(runs[0].model.named_parameters(), runs[1].model.parameters()):
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-3, msg=name)


def test_an_ensemble_per_fold_is_scored_on_its_mean_prediction():
    data = compounds(40)
    options = dict(dim=16, heads=2, depth=1, experts=2, expert_dim=16)
    rows, mean, models, predictions = tc.run_cross_validation(
        data, folds=2, split="random", epochs=2, device="cpu", backend="torch", baseline=False, batch_size=8,
        model_options=options, table=element_table(), ensemble=2)
    assert len(models) == 4 and all(len(row["member_r2"]) == 2 for row in rows)
    for fold, row in enumerate(rows):
        test = [c for c, f in zip(data, tc.assign_folds(data, 2, "random")) if f == fold]
        pred = torch.stack([tc.predict(m, test, "cpu") for m in models[2 * fold:2 * fold + 2]]).mean(0)
        assert row["model"] == tc.metrics(pred, [c.tc for c in test])
    assert models[0].state_dict()["embed.weight"].ne(models[1].state_dict()["embed.weight"]).any()  # own seeds
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="ensemble must be an int >= 1"):
            tc.run_cross_validation(data, folds=2, split="random", epochs=1, device="cpu", backend="torch",
                                    baseline=False, table=element_table(), ensemble=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_step_that_cannot_be_captured_is_named(monkeypatch):
    real = tc.train_step

    def reads_back(model, optimizer, *args):
        loss = real(model, optimizer, *args)
        loss.item()  # a host read: forbidden while capturing
        return loss

    monkeypatch.setattr(tc, "train_step", reads_back)
    with pytest.raises(RuntimeError, match="capturing the Tc training step in a CUDA graph failed"):
        tc.train_model(compounds(64), element_table(), "cuda", epochs=4, batch_size=32, cuda_graphs=True,
                       model_options=dict(dim=32, heads=2, depth=1, experts=2, expert_dim=16))
