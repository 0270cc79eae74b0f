"""Each endpoint's answer, whole and streamed, in OpenAI's shapes: reached only from serving/api/respond.py."""
