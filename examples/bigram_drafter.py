"""A drafter in one class: after the last token, copy what followed its most recent earlier occurrence."""
from genspec.drafters.base import Draft, Drafter, DrafterCapabilities


class BigramDrafter(Drafter):
    """A one-token prompt lookup. Free: no model runs, so its proposal is made before the draft-length plan,
    which weighs its evidence (1: a match, 0: none) and cuts it to the length that pays."""

    name = "bigram"
    capabilities = DrafterCapabilities(free=True)

    def propose(self, requests):
        chains, evidence = [], []
        for request in requests:
            sequence, last = request.sequence, len(request.sequence) - 1
            earlier = next((i for i in range(last - 1, -1, -1) if sequence[i] == sequence[last]), None)
            chain = [] if earlier is None else sequence[earlier + 1:earlier + 1 + request.max_tokens]
            chains.append([chain])
            evidence.append(int(bool(chain)))
        return Draft.from_chains(chains, evidence=evidence)


if __name__ == "__main__":
    import genspec

    engine = genspec.SpeculativeEngine(genspec.load_model(), BigramDrafter())  # the embedded model
    result = engine.generate("List the days of the week: Monday, Tuesday,", max_new_tokens=48)[0]
    print(result.text, f"{result.stats.mean_accepted_length:.2f} tokens per target call", sep="\n")
