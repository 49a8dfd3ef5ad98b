// Workloads (/admin/workloads): list, describe with events and timings, a log tail, submit and delete.
import { useState } from 'preact/hooks';
import { html } from '../html.js';
import { Gate } from '../gate.js';
import { usePoll } from '../poll.js';
import { Confirm } from '../confirm.js';
import { age, num } from '../format.js';

export function Workloads({ api }) {
  const [res, reload] = usePoll(api, '/admin/workloads', 3000);
  const [open, setOpen] = useState(null);
  return html`<section><h2>Workloads</h2>
    <${Gate} res=${res} what="Workloads">
      ${(d) => html`<div class="scroll"><table class="clickable">
        <thead><tr><th>Id</th><th>Model · version</th><th>Host</th><th>Devices</th><th>Status</th>
          <th>Restarts</th><th>Age</th></tr></thead>
        <tbody>${d.data.map((w) => html`<tr data-workload=${w.id} onClick=${() => setOpen(w.id)}
          class=${open === w.id ? 'picked' : ''}>
          <td>${w.id}</td><td>${w.model} · ${w.version ?? '–'}</td><td>${w.host}</td>
          <td>${(w.devices || []).join(', ')}</td><td class=${`st-${w.status}`}>${w.status}</td>
          <td>${w.restarts}</td><td>${age(w.age_s)}</td></tr>`)}</tbody></table></div>
        ${d.data.length ? '' : html`<p class="muted">No workloads.</p>`}
        ${open ? html`<${Detail} api=${api} id=${open} onGone=${() => { setOpen(null); reload(); }} />` : ''}
        <${Submit} api=${api} reload=${reload} />`}
    <//></section>`;
}

function Detail({ api, id, onGone }) {
  const path = `/admin/workloads/${encodeURIComponent(id)}`;
  const [res] = usePoll(api, path, 3000);
  const [logs, setLogs] = useState(null);
  const [asking, setAsking] = useState(false);
  const [err, setErr] = useState(null);
  const tail = async () => {
    try {
      setLogs(await api.text(`${path}/logs?tail=200`));
    } catch (e) {
      setLogs(`(${e.status}) ${e.message}`);
    }
  };
  const remove = async () => {
    setAsking(false);
    try {
      await api.del(path);
      onGone();
    } catch (e) {
      setErr(`Refused (${e.status}): ${e.message}`);
    }
  };
  return html`<div class="card"><${Gate} res=${res} what=${`Workload ${id}`}>
    ${(w) => html`<h3>${w.id} <span class=${`st-${w.status}`}>${w.status}</span></h3>
      <p class="small">Target ${w.target_device ?? '–'} · load ${num(w.load_s)} s · compile ${num(w.compile_s)} s ·
        first token ${num(w.first_token_s)} s · ${w.url ?? ''}</p>
      <table><thead><tr><th>At</th><th>Event</th><th>Detail</th></tr></thead><tbody>
        ${(w.events || []).map((e) => html`<tr><td class="small">${e.at}</td><td>${e.event}</td>
          <td class="small">${typeof e.detail === 'string' ? e.detail : JSON.stringify(e.detail)}</td></tr>`)}
      </tbody></table>
      <div class="toolbar"><button type="button" onClick=${tail}>Log tail</button>
        <button type="button" class="danger" onClick=${() => setAsking(true)}>Delete…</button>
        ${err ? html`<span class="bad">${err}</span>` : ''}</div>
      ${logs != null ? html`<pre class="logs">${logs}</pre>` : ''}
      ${asking ? html`<${Confirm} title=${`Delete workload ${id}?`} action="Drain and stop"
        body=${html`<p>It drains its requests, then stops.</p>`} onYes=${remove}
        onNo=${() => setAsking(false)} />` : ''}`}
  <//></div>`;
}

const FIELDS = [['model', 'model name or path'], ['device', 'simxpu:0 (or leave empty)'],
  ['device_type', 'or a device type: cpu'], ['version', 'version label'], ['tp_size', '1'],
  ['quantization', 'none'], ['kv_cache_dtype', 'auto'], ['serve_args', 'more serve flags']];

function Submit({ api, reload }) {
  const [f, setF] = useState({});
  const [msg, setMsg] = useState(null);
  const send = async (e) => {
    e.preventDefault();
    const body = {};
    for (const [k] of FIELDS) if (f[k]) body[k] = f[k];
    if (body.tp_size) body.tp_size = Number(body.tp_size);
    if (body.serve_args) body.serve_args = body.serve_args.split(/\s+/).filter(Boolean);
    try {
      const w = await api.post('/admin/workloads', body);
      setMsg({ ok: true, text: `Submitted ${w.id} (${w.status})` });
      reload();
    } catch (err) {
      setMsg({ ok: false, text: `Refused (${err.status}): ${err.message}` });
    }
  };
  return html`<form class="card form" onSubmit=${send}><h3>Submit a workload</h3>
    ${FIELDS.map(([k, hint]) => html`<label>${k}<input name=${k} placeholder=${hint} value=${f[k] || ''}
      onInput=${(e) => setF({ ...f, [k]: e.currentTarget.value })} /></label>`)}
    <div class="toolbar"><button type="submit" disabled=${!f.model}>Submit</button>
      ${msg ? html`<span class=${msg.ok ? 'ok' : 'bad'}>${msg.text}</span>` : ''}</div></form>`;
}
