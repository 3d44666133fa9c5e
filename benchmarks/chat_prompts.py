"""The short chat prompts the benchmark scripts here decode (the first is the README's)."""

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in three sentences why the sky is blue.",
    "What is the difference between a list and a tuple in Python?",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Give three tips for writing readable code.",
    "Write a haiku about the sea.",
    "How do I reverse a string in Python?",
]
