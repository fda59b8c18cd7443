"""`zeropp plan`: its arithmetic against docs/algorithms.md's table, and bad input."""

from __future__ import annotations

import pytest

from zeropp.bench.plan import Cluster, plan, predict, winner
from zeropp.cli.main import main

BIG = Cluster(params=7e9, nodes=256, gpus_per_node=8, inter_gbps=100, intra_gbps=2400,
              tokens_per_gpu=2048, tflops=300)
M = 7e9 * 2


def test_zero3_moves_3m_and_zeropp_075m_across_nodes_per_step():
    """docs/algorithms.md: ZeRO-3 M + M + M = 3M; ZeRO++ 0.5M (qwZ) + 0 (hpZ) + 0.25M (qgZ)
    = 0.75M, as the node count grows ((W-1)/W -> 1), scales included (+0.2%)."""
    z3, zpp = predict(BIG, "zero3"), predict(BIG, "zeropp")
    assert z3["cross"] / M == pytest.approx(3.0, rel=0.01)
    assert (z3["fwd"], z3["bwd"], z3["grad"]) == pytest.approx((M, M, M), rel=0.01)
    assert zpp["cross"] / M == pytest.approx(0.75, rel=0.01)
    assert zpp["fwd"] / M == pytest.approx(0.5, rel=0.01) and zpp["bwd"] == 0
    assert zpp["grad"] / M == pytest.approx(0.25, rel=0.01)


def test_zeropp_plus_moves_half_of_zeropp_across_nodes_and_keeps_int8_copies():
    """qWD's INT4 deltas (0.25M in bf16) replace qwZ's INT8 gather (0.5M); qgZ stays
    0.25M: 0.5M per node per step. Its copies are INT8 blocks, 1 byte per param / D
    per GPU (0.875 GB, 7B, D=8), as ZeRO++'s secondary; inside the node both gathers
    move INT8, as ZeRO++'s backward gather does, and the gradient hop 8 bits."""
    plus, zpp = predict(BIG, "zeropp-plus"), predict(BIG, "zeropp")
    assert plus["cross"] / M == pytest.approx(0.5, rel=0.01)
    assert plus["fwd"] / M == pytest.approx(0.25, rel=0.01) and plus["bwd"] == 0
    assert plus["secondary"] == pytest.approx(0.875e9, rel=0.01) == zpp["secondary"]
    gather8 = 7 / 8 * 7e9 * (1 + 4 / 2048)  # one INT8 gather inside a node of 8
    assert plus["intra"] == pytest.approx(3 * gather8, rel=1e-6)
    assert zpp["intra"] == pytest.approx(gather8 * 1.5, rel=1e-3)


def test_hpz_secondary_memory_for_7b_on_8_gpus_is_175gb_or_half_with_qwz():
    assert predict(BIG, "hpz")["secondary"] == pytest.approx(1.75e9, rel=0.001)
    assert predict(BIG, "zeropp")["secondary"] == pytest.approx(0.875e9, rel=0.01)


def test_one_node_moves_nothing_across_and_speedup_follows_the_bottleneck():
    one = Cluster(params=1e9, nodes=1, gpus_per_node=8, inter_gbps=100, intra_gbps=2400,
                  tokens_per_gpu=2048, tflops=300)
    assert all(predict(one, k)["cross"] == 0 for k in ("zero3", "zeropp"))
    slow = plan(Cluster(params=1e9, nodes=4, gpus_per_node=8, inter_gbps=10, intra_gbps=2400,
                        tokens_per_gpu=2048, tflops=300))
    fast = plan(Cluster(params=1e9, nodes=4, gpus_per_node=8, inter_gbps=1600,
                        intra_gbps=2400, tokens_per_gpu=2048, tflops=300))
    assert slow[-1]["speedup"] > fast[-1]["speedup"] > 1


@pytest.mark.parametrize("args,msg", [
    (["--nodes", "0"], "nodes=0 must be an integer >= 1"),
    (["--inter-gbps", "-1"], "inter_gbps=-1.0 must be positive"),
    (["--overlap", "2"], "overlap=2.0 must be in [0, 1]"),
])
def test_bad_plan_input_is_one_line(args, msg, capsys):
    base = {"--params": "7e9", "--nodes": "16", "--gpus-per-node": "8", "--inter-gbps": "100"}
    base.update(dict(zip(args[::2], args[1::2])))
    rc = main(["plan", *[x for kv in base.items() for x in kv]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0]


def test_plan_prints_a_table_and_a_recommendation(capsys):
    assert main(["plan", "--params", "7e9", "--nodes", "16", "--gpus-per-node", "8",
                 "--inter-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "| zeropp |" in out and "Turn on quantized_weights=True" in out


def test_plan_json_gives_every_config_with_bytes_times_and_the_advice(capsys):
    import json
    assert main(["plan", "--params", "7e9", "--nodes", "4", "--gpus-per-node", "8",
                 "--inter-gbps", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["nodes"] == 4 and out["cluster"]["inter_gbps"] == 100
    by = {r["config"]: r for r in out["configs"]}
    assert set(by) == {"zero3", "qwz", "hpz", "qgz", "zeropp", "zeropp-plus"}
    assert by["zero3"]["speedup"] == 1.0 and by["zeropp"]["cross"] < by["zero3"]["cross"]
    assert by["zeropp"]["step_s"] == pytest.approx(by["zeropp"]["compute_s"]
                                                   + by["zeropp"]["comm_s"])  # overlap 0
    assert out["recommendation"].startswith(("Turn on", "Communication is not"))


def test_overlap_hides_each_phase_only_behind_its_own_compute():
    """Full overlap, the cross-node link alone (no latency, an instant intra link):
    ZeRO-3's traffic splits like its compute (a gather forward; a gather and a
    reduce-scatter backward, 1:2 as the FLOPs), so its step is max(compute, comm).
    ZeRO++ puts 2/3 of its bytes in the forward's qwZ gather against 1/3 of the
    compute: with 0.9 s of compute, its forward is link-bound (0.56 s against 0.3)
    and its backward compute-bound (0.6 against 0.28), so its step is 0.56 + 0.6 =
    1.16 s, 1.29x max(compute, comm) = 0.9."""
    import dataclasses
    c = dataclasses.replace(BIG, overlap=1.0, alpha_us=0.0, intra_gbps=1e12, compute_s=0.9)
    z3 = predict(c, "zero3")
    assert z3["step_s"] == pytest.approx(max(z3["compute_s"], z3["comm_s"]))
    zpp = predict(c, "zeropp")
    inter = c.inter_gbps * 1e9 / 8
    fwd, bwd = zpp["fwd"] / inter, (zpp["bwd"] + zpp["grad"]) / inter
    assert (fwd, bwd) == pytest.approx((0.56, 0.28), rel=0.01)
    assert zpp["step_s"] == pytest.approx(fwd + 0.6)
    assert zpp["step_s"] / max(0.9, zpp["comm_s"]) == pytest.approx(1.29, abs=0.01)
    no = predict(dataclasses.replace(c, overlap=0.0), "zeropp")  # no overlap: the plain sum
    assert no["step_s"] == pytest.approx(0.9 + zpp["comm_s"])


def test_activation_checkpointing_charges_8_instead_of_6_flops_per_param_per_token():
    import dataclasses
    plain = predict(BIG, "zero3")
    ckpt = predict(dataclasses.replace(BIG, recompute=True), "zero3")
    assert ckpt["compute_s"] == pytest.approx(plain["compute_s"] * 8 / 6)
    assert ckpt["comm_s"] == plain["comm_s"]  # the bytes do not change


def test_presets_within_5pct_send_the_user_to_measure_with_rounds(capsys):
    """At 1 Gbit/s on the emulated 2 x 2 cluster the model predicts a tie (0.825 vs
    0.828 s) where measured, zeropp won 3 rounds of 3 by 3-6% (RESULTS.md): the advice
    says that the model leaves out zeropp-plus's quantization passes. At 100 Mbit/s
    (1.32x apart) it does not."""
    def advice(gbps: str) -> str:
        assert main(["plan", "--params", "10.8e6", "--nodes", "2", "--gpus-per-node", "2",
                     "--inter-gbps", gbps, "--intra-gbps", "1.6", "--param-bytes", "4",
                     "--reduce-bytes", "4", "--units", "7", "--compute-s", "0.7"]) == 0
        return capsys.readouterr().out.strip().splitlines()[-1]
    assert "The two presets are within 5% here" in advice("1")
    assert "zeropp bench --rounds 3" in advice("1")
    assert "within 5%" not in advice("0.1")


def test_winner_names_the_fastest_configuration_and_its_margin_over_the_next():
    line = winner({"zeropp": 1.2, "fsdp2": 12.0, "zeropp-plus": 0.8}, "measured")
    assert line == ("Fastest (measured): Config.preset('zeropp-plus') at 0.8 s/step, "
                    "1.50x faster than zeropp (1.2 s).")
    assert winner({"fsdp2": 1.0, "zeropp": 2.0}, "measured").startswith(
        "Fastest (measured): fsdp2 at 1 s/step, 2.00x faster than zeropp")
