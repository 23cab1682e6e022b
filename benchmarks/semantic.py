"""`python -m benchmarks.routing --semantic`: how often semantic_hash puts paraphrases together, against prefix_hash.

A fixed list of paraphrase pairs and of unrelated pairs, in English and Chinese (the issue's refund pairs
among them), each question placed by consumers' Partitioner over --buckets partitions: semantic_hash
(the model's embedding layer, engine/routing_embedding.py) and prefix_hash (the text hash it was before
issue 40). Prints, per strategy and language, the fraction of each kind of pair that shares a bucket
(chance: 1/buckets), how many buckets the distinct questions fill and the fullest one's share, and the
cost of one question's partition in microseconds; then the same pairs under --seeds other hyperplane
seeds, so one seed's luck is not mistaken for the rule's. No target: a 135M model's input embeddings know little
about meaning; this reports what they give.
"""

from __future__ import annotations

import argparse
import statistics
import time

PARAPHRASES = (
    ("How do I get a refund?", "How can I get my money back?"),
    ("How do I reset my password?", "I forgot my password. How can I change it?"),
    ("How do I change my shipping address?", "Can I update the delivery address on my order?"),
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("Will it rain tomorrow?", "What's the weather forecast for tomorrow?"),
    ("How do I cancel my subscription?", "I want to stop my subscription. What do I do?"),
    ("Where is my package?", "Can you track my order for me?"),
    ("How long does delivery take?", "When will my order arrive?"),
    ("怎么退款", "如何退款"),
    ("怎么修改地址", "如何更改收货地址"),
    ("我忘记密码了怎么办", "密码忘了怎么重置"),
    ("今天天气怎么样", "今天的天气如何"),
    ("北京是中国的首都吗", "中国的首都是北京吗"),
    ("怎么取消订阅", "如何退订会员"),
    ("我的快递到哪了", "帮我查一下物流"),
    ("发货要多久", "什么时候能收到货"),
)
UNRELATED = (
    ("How do I get a refund?", "What is the capital of France?"),
    ("How do I reset my password?", "Write a short poem about the sea."),
    ("How do I change my shipping address?", "Explain quantum entanglement simply."),
    ("Will it rain tomorrow?", "How do I bake sourdough bread?"),
    ("How do I cancel my subscription?", "Who wrote Romeo and Juliet?"),
    ("Where is my package?", "What is a hash map?"),
    ("How long does delivery take?", "Translate 'good morning' into Spanish."),
    ("What is the capital of France?", "How do I fix a flat bicycle tyre?"),
    ("怎么退款", "今天天气怎么样"),
    ("怎么修改地址", "写一首关于春天的诗"),
    ("我忘记密码了怎么办", "北京是中国的首都吗"),
    ("今天天气怎么样", "解释一下量子纠缠"),
    ("怎么取消订阅", "红烧肉怎么做"),
    ("我的快递到哪了", "李白是哪个朝代的诗人"),
    ("发货要多久", "什么是哈希表"),
    ("如何退款", "推荐几本科幻小说"),
)
ISSUE_PAIRS = (PARAPHRASES[0], PARAPHRASES[8])  # the refund pairs issue 40 saw split by the text hash
STRATEGIES = ("semantic_hash", "prefix_hash")
SEED_NAME = "engine.routing_embedding.SEED"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--buckets", type=int, default=16, help="partitions the pairs are placed over (default 16)")
    parser.add_argument("--rounds", type=int, default=50, help="timing rounds over every question (default 50)")
    parser.add_argument("--seeds", type=int, default=100, help="other hyperplane seeds to average over (default 100)")


def run(args: argparse.Namespace) -> int:
    from engine.model.loader import resolve_model_dir  # imports torch: before the clock starts
    from engine.routing_embedding import EmbeddingHash
    from kev_async.bench.machine import cpu_name

    path = resolve_model_dir(args.model)
    started = time.perf_counter()
    semantic = EmbeddingHash.from_model_dir(path)
    load_s = time.perf_counter() - started
    print(f"semantic_hash vs prefix_hash: {len(PARAPHRASES)} paraphrase and {len(UNRELATED)} unrelated pairs "
          f"(English and Chinese, half each), {args.buckets} buckets (chance {1 / args.buckets:.3f})")
    print(f"CPU: {cpu_name()}; model {args.model}: embedding table {semantic.table.shape[0]} x "
          f"{semantic.table.shape[1]}, read and centred in {load_s:.2f} s")
    print(f"{'strategy':14} {'pairs':8} {'paraphrase':>12} {'unrelated':>12} {'buckets':>8} {'fullest':>8} "
          f"{'us/question':>12}")
    for strategy in STRATEGIES:
        partition = _partition(strategy, args.buckets, semantic)
        cost = _cost_us(partition, args.rounds)
        for language, keep in (("all", lambda i: True), ("English", lambda i: i < 8), ("Chinese", lambda i: i >= 8)):
            para = [pair for i, pair in enumerate(PARAPHRASES) if keep(i)]
            unrelated = [pair for i, pair in enumerate(UNRELATED) if keep(i)]
            used, fullest = _spread(partition, para + unrelated)
            print(f"{strategy:14} {language:8} {_together(partition, para):>12} {_together(partition, unrelated):>12} "
                  f"{used:>8} {fullest:>8.2f} {cost if language == 'all' else '':>12}")
    partition = _partition("semantic_hash", args.buckets, semantic)
    for a, b in ISSUE_PAIRS:
        print(f"semantic_hash: {a!r} -> {partition(a)}, {b!r} -> {partition(b)}")
    if args.seeds:
        para, unrelated = _over_seeds(semantic, args.buckets, args.seeds)
        print(f"semantic_hash with hyperplane seeds 0..{args.seeds - 1} instead of {SEED_NAME}: mean same-bucket "
              f"fraction {para:.2f} of paraphrase pairs, {unrelated:.2f} of unrelated pairs")
    return 0


def _partition(strategy: str, buckets: int, semantic):
    """A question's text -> its partition, through the partitioner `kev route` uses."""
    from consumers.publish.partitioner import Partitioner
    from schemas import QuestionEvent

    partitioner = Partitioner(strategy, buckets, semantic=semantic if strategy == "semantic_hash" else None)
    return lambda text: partitioner.partition(QuestionEvent(question_id="bench", prompt=text))


def _over_seeds(semantic, buckets: int, seeds: int) -> tuple[float, float]:
    """The mean same-bucket fractions of the paraphrase and the unrelated pairs over `seeds` hyperplane seeds."""
    para, unrelated = [], []
    for seed in range(seeds):
        partition = _partition("semantic_hash", buckets, semantic.reseeded(seed))
        para.append(sum(partition(a) == partition(b) for a, b in PARAPHRASES) / len(PARAPHRASES))
        unrelated.append(sum(partition(a) == partition(b) for a, b in UNRELATED) / len(UNRELATED))
    return statistics.mean(para), statistics.mean(unrelated)


def _together(partition, pairs) -> str:
    together = sum(partition(a) == partition(b) for a, b in pairs)
    return f"{together}/{len(pairs)} {together / len(pairs):.2f}"


def _spread(partition, pairs) -> tuple[int, float]:
    """Buckets the distinct questions of `pairs` fill, and the share of them in the fullest."""
    texts = {text for pair in pairs for text in pair}
    counts: dict[int, int] = {}
    for text in texts:
        counts[partition(text)] = counts.get(partition(text), 0) + 1
    return len(counts), max(counts.values()) / len(texts)


def _cost_us(partition, rounds: int) -> str:
    """The median over rounds of one question's partition time, every question of the lists each round."""
    texts = [text for pair in PARAPHRASES + UNRELATED for text in pair]
    per_round = []
    for _ in range(rounds):
        started = time.perf_counter()
        for text in texts:
            partition(text)
        per_round.append((time.perf_counter() - started) / len(texts) * 1e6)
    return f"{statistics.median(per_round):.1f}"
