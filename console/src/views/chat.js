// Chat: a streaming playground. Pick the model, its version (the x-polychip-version request header
// pins it) and a preferred device type; each answer shows its thinking apart from its text, where it
// ran (x-polychip-replica, x-polychip-device), its TTFT and tokens/s.
import { useEffect, useRef, useState } from 'preact/hooks';
import { html } from '../html.js';
import { Gate } from '../gate.js';
import { usePoll } from '../poll.js';
import { streamChat } from '../stream.js';
import { ms, num } from '../format.js';

export function Chat({ api }) {
  const [models] = usePoll(api, '/v1/models', 0);
  return html`<section><h2>Chat</h2>
    <${Gate} res=${models} what="Models">
      ${(d) => html`<${Playground} api=${api} models=${d.data.map((m) => m.id)} />`}
    <//></section>`;
}

function useOptional(api, path) {
  const [res] = usePoll(api, path, 0);
  return res.state === 'ok' ? res.data : null;
}

function Playground({ api, models }) {
  const rollout = useOptional(api, '/admin/rollout');
  const replicas = useOptional(api, '/admin/replicas');
  const [model, setModel] = useState(models[0] || '');
  const [version, setVersion] = useState('');
  const [device, setDevice] = useState('');
  const [maxTokens, setMaxTokens] = useState(128);
  const [turns, setTurns] = useState([]);
  const [text, setText] = useState('');
  const [busy, setBusy] = useState(null);
  const versions = rollout && rollout.models[model] ? Object.keys(rollout.models[model].versions) : [];
  const types = replicas ? [...new Set(replicas.replicas.filter((r) => r.model === model && r.device_type)
    .map((r) => r.device_type))].sort() : [];
  const end = useRef(null);
  useEffect(() => end.current && end.current.scrollIntoView({ block: 'end' }), [turns]);

  const send = async (e) => {
    e.preventDefault();
    if (!text.trim() || busy) return;
    const history = [...turns.map((t) => ({ role: t.role, content: t.content })), { role: 'user', content: text }];
    const body = { model, messages: history, stream: true, stream_options: { include_usage: true },
                   max_tokens: Number(maxTokens) || 128, temperature: 0 };
    if (device) body.preferred_device_types = [device];
    const headers = version ? { 'x-polychip-version': version } : {};
    const abort = new AbortController();
    setBusy(abort);
    setText('');
    const shown = [...turns, { role: 'user', content: text }];
    setTurns([...shown, { role: 'assistant', content: '', pending: true }]);
    const show = (a) => setTurns([...shown, { role: 'assistant', ...a, pending: true }]);
    try {
      const a = await streamChat(api, body, { headers, signal: abort.signal, onUpdate: show });
      setTurns([...shown, { role: 'assistant', ...a }]);
    } catch (err) {
      setTurns([...shown, { role: 'assistant', content: '', error: err.name === 'AbortError' ? 'stopped'
        : `${err.status ?? ''} ${err.message}` }]);
    } finally {
      setBusy(null);
    }
  };
  return html`
    <form class="toolbar chat-opts">
      <label>Model <select name="model" value=${model} onChange=${(e) => { setModel(e.currentTarget.value); setVersion(''); }}>
        ${models.map((m) => html`<option value=${m}>${m}</option>`)}</select></label>
      <label>Version <select name="version" value=${version} onChange=${(e) => setVersion(e.currentTarget.value)}>
        <option value="">by weight</option>${versions.map((v) => html`<option value=${v}>${v}</option>`)}</select></label>
      <label>Device type <select name="device" value=${device} onChange=${(e) => setDevice(e.currentTarget.value)}>
        <option value="">any</option>${types.map((t) => html`<option value=${t}>${t}</option>`)}</select></label>
      <label>Max tokens <input type="number" name="max_tokens" min="1" value=${maxTokens}
        onInput=${(e) => setMaxTokens(e.currentTarget.value)} /></label>
      <button type="button" class="quiet" onClick=${() => setTurns([])}>Clear</button>
    </form>
    <div class="turns">${turns.map((t, i) => html`<${Turn} t=${t} i=${i} />`)}<div ref=${end}></div></div>
    <form class="ask" onSubmit=${send}>
      <textarea name="prompt" rows="2" placeholder="Ask something" value=${text}
        onInput=${(e) => setText(e.currentTarget.value)}
        onKeyDown=${(e) => { if (e.key === 'Enter' && !e.shiftKey) send(e); }}></textarea>
      ${busy ? html`<button type="button" onClick=${() => busy.abort()}>Stop</button>`
        : html`<button type="submit" data-action="send">Send</button>`}
    </form>`;
}

function Turn({ t, i }) {
  if (t.role === 'user') return html`<div class="turn user"><div class="bubble">${t.content}</div></div>`;
  return html`<div class=${`turn assistant${t.pending ? ' pending' : ''}`} data-turn=${i}>
    ${t.thinking ? html`<details class="thinking" open=${t.pending}><summary>Thinking</summary>
      <div data-thinking>${t.thinking}</div></details>` : ''}
    <div class="bubble" data-answer>${t.content}${t.pending && !t.content ? '…' : ''}</div>
    ${t.error ? html`<div class="bad small" data-error>${t.error}</div>` : ''}
    ${!t.pending && !t.error ? html`<div class="meta small" data-meta>
      <span data-replica>${t.replica ?? 'this server'}</span> · <span data-device>${t.device ?? '–'}</span> ·
      version ${t.version ?? '–'} ·
      TTFT <span data-ttft>${ms(t.ttft)}</span> · <span data-rate>${num(t.decodeRate)}</span> tok/s
      ${t.tokens != null ? html` · <span data-tokens>${t.tokens}</span> tokens` : ''}</div>` : ''}
  </div>`;
}
