// One streamed chat completion: fetch's body read as server-sent events (eventsource-parser),
// reasoning_content and content kept apart, and the timings the Chat view shows.
import { createParser } from 'eventsource-parser';

export async function streamChat(api, body, { headers = {}, signal, onUpdate }) {
  const t0 = performance.now();
  const resp = await api.request('POST', '/v1/chat/completions', { json: body, signal, headers });
  const out = {
    replica: resp.headers.get('x-polychip-replica'), device: resp.headers.get('x-polychip-device'),
    version: resp.headers.get('x-polychip-version'), thinking: '', content: '', ttft: null, tokens: null,
    chunks: 0, error: null, elapsed: null, decodeRate: null,
  };
  let tFirst = null;
  let tLast = null;
  const parser = createParser({
    onEvent(event) {
      if (event.data === '[DONE]') return;
      const msg = JSON.parse(event.data);
      if (msg.error) {
        out.error = msg.error.message || JSON.stringify(msg.error);
        return;
      }
      const delta = (msg.choices && msg.choices[0] && msg.choices[0].delta) || {};
      const piece = (delta.reasoning_content || '') + (delta.content || '');
      if (piece) {
        const now = performance.now();
        if (tFirst == null) tFirst = now;
        tLast = now;
        out.chunks += 1;
      }
      out.thinking += delta.reasoning_content || '';
      out.content += delta.content || '';
      if (msg.usage) out.tokens = msg.usage.completion_tokens;
    },
  });
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    parser.feed(value);
    onUpdate({ ...out, ttft: tFirst == null ? null : (tFirst - t0) / 1000 });
  }
  out.ttft = tFirst == null ? null : (tFirst - t0) / 1000;
  out.elapsed = (performance.now() - t0) / 1000;
  const n = out.tokens ?? out.chunks;
  // decode speed: tokens after the first over the time after the first (llama.cpp's figure)
  if (n > 1 && tLast > tFirst) out.decodeRate = (n - 1) / ((tLast - tFirst) / 1000);
  onUpdate(out);
  return out;
}
