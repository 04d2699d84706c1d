"""A user-defined reward, loaded in the tests by dotted path (`tests.rewards.custom_reward_example`)."""


def length_reward(response: str, answer: str, prompt: str) -> float:
    """1.0 when the response is as long as the answer, less the further it is."""
    return 1.0 / (1.0 + abs(len(response) - len(answer)))


def returns_none(response, answer, prompt):
    return None


def returns_string(response, answer, prompt):
    return "1.0"


def returns_nan(response, answer, prompt):
    return float("nan")


def out_of_range(response, answer, prompt):
    return 5.0 if response == "big" else -3.0


class Scorers:
    @staticmethod
    def always_half(response, answer, prompt):
        return 0.5


NOT_CALLABLE = 3
