"""The closing "next:" lines of a finished training run suit what it trained: a text model is generated
from, served and exported (as the README quotes); the sort task's SFT is the start of the RL demo."""
import os
import re

from glm5_jax.data.sort_task import SORT, prompt_ids, sort_tokenizer
from glm5_jax.train.loop import finished_message

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def test_text_run_message_is_the_one_the_readme_quotes():
    message = finished_message("/tmp/glm5_tiny", 300)
    assert f"```\n{message}\n```" in open(README).read()
    assert finished_message("/tmp/glm5_tiny", 300, "files") == message


def test_sort_sft_message_names_the_rl_run_and_a_sort_prompt():
    message = finished_message("/tmp/glm5_rl_sort/sft", 300, SORT)
    assert message.startswith("done: step 300 is checkpointed in /tmp/glm5_rl_sort/sft/checkpoints/300\nnext:\n")
    assert "python -m glm5_jax.rl.run --config=configs/rl_sort.py --workdir=RL_DIR " \
           "--set=sft_workdir=/tmp/glm5_rl_sort/sft" in message
    assert "def main(" not in message and "glm5_jax.serve" not in message
    prompt = re.search(r"--checkpoint=/tmp/glm5_rl_sort/sft --prompt='([^']*)'", message).group(1)
    # the suggested prompt is a task prompt (S, 6 digits, =) in the task's own tokenizer
    digits = [int(c) for c in prompt[1:-1]]
    assert list(sort_tokenizer().encode(prompt)) == list(prompt_ids(digits))
