"""Stream an answer from a running `caddtree serve`, then print its acceptance metrics.
Usage: python examples/openai_client.py [BASE_URL]   (default http://127.0.0.1:8000)"""

import sys
import urllib.request

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
client = OpenAI(base_url=f"{base}/v1", api_key="unused")
question = "Write a Python function that checks whether a number is prime."
stream = client.chat.completions.create(
    model=client.models.list().data[0].id,
    messages=[{"role": "user", "content": question}],
    temperature=0,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
metrics = urllib.request.urlopen(f"{base}/metrics").read().decode().splitlines()
print("\n" + "\n".join(m for m in metrics if "accept" in m and not m.startswith("#")))
