"""How often the target accepts copies from the context, by match class and depth: the source of
:data:`caddtree.core.copies.PRIOR_BY_CLASS`.

    python benchmarks/copy_rates.py [--data training-data/smollm2-135m-instruct/data.safetensors]
                                    [--every 50] [--depth 8]

Replays the target's own responses in the committed training data (every ``--every``-th sample):
before each response token, the index holds the prompt and the response so far, the round's trie
is built as decoding builds it (:func:`caddtree.core.copies.copy_trie`), and
:meth:`~caddtree.core.copies.CopyRates.observe` counts its copies against the tokens the target
actually wrote next, exactly as a verified round counts them. Prints, per match class (the length
of the longest match of the text's end with an earlier occurrence) and depth, the share of copies
accepted given their parent was, with the number of trials.
"""

from __future__ import annotations

import argparse

from caddtree.core.copies import CLASS_BOUNDS, MAX_DEPTH_BUCKET, ContextIndex, CopyRates, copy_trie
from caddtree.train.data import TrainingData


def replay(data: TrainingData, every: int, depth: int) -> CopyRates:
    """The counts of every ``every``-th sample's copies, as verified rounds would count them."""
    counts = CopyRates()
    for sequence, start in zip(data.sequences[::every], data.prompt_lengths[::every]):
        tokens = sequence.tolist()
        index = ContextIndex(tokens[: start + 1])
        for t in range(start + 1, len(tokens)):
            trie = copy_trie(index, counts, depth)
            counts.observe(trie, tokens[t : t + depth])
            index.extend(tokens[t : t + 1])
    return counts


def class_label(c: int) -> str:
    low = CLASS_BOUNDS[c - 1]
    high = CLASS_BOUNDS[c] - 1 if c < len(CLASS_BOUNDS) else None
    return str(low) if high == low else f"{low}-{high}" if high else f"{low}+"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="training-data/smollm2-135m-instruct/data.safetensors")
    parser.add_argument("--every", type=int, default=50, help="replay every N-th sample")
    parser.add_argument("--depth", type=int, default=8, help="how deep a round's copies go")
    args = parser.parse_args()
    data = TrainingData.load(args.data)
    counts = replay(data, args.every, args.depth)
    samples = len(data.sequences[:: args.every])
    print(f"{samples} of {len(data.sequences)} samples; accepted share (trials) by depth")
    print("match   " + "".join(f"{d:>13d}" for d in range(1, MAX_DEPTH_BUCKET + 1)))
    for c in range(1, len(CLASS_BOUNDS) + 1):
        cells = []
        for d in range(1, MAX_DEPTH_BUCKET + 1):
            trials, hits = counts.trials[c, d], counts.hits[c, d]
            cells.append(f"{hits / trials:.2f} ({int(trials)})" if trials else "-")
        print(f"{class_label(c):8s}" + "".join(f"{cell:>13s}" for cell in cells))


if __name__ == "__main__":
    main()
