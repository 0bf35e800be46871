"""A small built-in English corpus for training the offline test tokenizer.

The text is original and deliberately repetitive in the words a chat model sees most (role names, common
function words, punctuation) so byte-level BPE learns them as whole tokens.
"""

from __future__ import annotations

_PARAGRAPHS = (
    "The quick brown fox jumps over the lazy dog. A small model can still say hello to the world.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "Please tell me a short story about a cat who learns to sing. The cat sang a song every morning.",
    "The weather is nice and the sun is bright. We went for a walk in the park and saw many birds.",
    "Can you help me write a letter to my friend? Of course, I can help you with that letter.",
    "Music is made of sound and time. A voice can speak words, and a speaker can turn text into speech.",
    "The assistant answers the question. The user asks the question. The system sets the rules.",
    "Numbers like one, two, three, four, five, six, seven, eight, nine and ten are easy to count.",
    "This is a test of the text to speech system. It should read every word clearly and slowly.",
    "What is the capital of France? The capital of France is Paris, a city on the river Seine.",
    "Good morning, good evening, and good night. Thank you very much for your time and your help.",
    "We need to finish the work before the end of the day, so let us start right now and keep going.",
    "The engine runs each stage in order: first the thinker writes text, then the talker makes sound.",
    "A request arrives, the scheduler picks it, the runner computes the step, and the output returns.",
    "She said that the answer was simple, but he thought about it for a long time before he agreed.",
    "In the morning we drink tea or coffee, and in the afternoon we read books and listen to music.",
    "The children played in the garden while their parents cooked dinner in the small warm kitchen.",
    "Where are you going? I am going to the store to buy some bread, milk, eggs, apples and cheese.",
    "There are many ways to learn a new language: read often, listen carefully, and speak every day.",
    "The train leaves at nine in the morning and arrives in the city just after noon on most days.",
)

# Role words and chat structure appear at the start of lines, exactly as the chat template renders them,
# so "system", "user" and "assistant" become single tokens without a leading space.
_ROLE_LINES = (
    "system\nYou are a helpful assistant.\n",
    "user\nHello, who are you?\n",
    "assistant\nI am a helpful assistant that can speak and write.\n",
    "user\nPlease say something nice.\n",
    "assistant\nYou are doing a great job today.\n",
)


def training_corpus() -> list[str]:
    """Return the corpus lines. Deterministic: a fixed tuple, repeated to give stable merge counts."""
    lines: list[str] = []
    for repeat in range(3):
        lines.extend(_PARAGRAPHS)
        # The role lines get a higher weight than ordinary text.
        lines.extend(_ROLE_LINES * (repeat + 2))
    return lines
