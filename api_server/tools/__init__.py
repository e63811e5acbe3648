"""Tool calling through the chat API (issue 42): `tools`, `tool_choice`, `parallel_tool_calls`,
tool calls and results in the history, and calls in the answer, whole or streamed.

spec (the request's fields, checked; the grammar constraint of required and named choices),
history (messages for the chat template), plan (what the template and the parsers allow),
parsers (each family's format), jsonscan (JSON that is still arriving), assembler (text → OpenAI
deltas, and the whole message as their fold), marker_text (the answer's text with the format's
special-token markers the daemons drop), content_logprobs (which logprob entries are content).
"""
