// Batches (OpenAI's /v1/files and /v1/batches): list with counts and progress, submit a JSONL
// file, download the output, cancel.
import { useState } from 'preact/hooks';
import { html } from '../html.js';
import { Gate } from '../gate.js';
import { usePoll } from '../poll.js';
import { when } from '../format.js';

const ENDPOINTS = ['/v1/chat/completions', '/v1/completions'];
const FINAL = new Set(['completed', 'failed', 'expired', 'cancelled', 'cancelling']);

export function Batches({ api }) {
  const [res, reload] = usePoll(api, '/v1/batches', 3000);
  return html`<section><h2>Batches</h2>
    <${Gate} res=${res} what="Batches">
      ${(d) => html`<div class="scroll"><table>
        <thead><tr><th>Id</th><th>Endpoint</th><th>Status</th><th>Progress</th><th>Created</th>
          <th></th></tr></thead>
        <tbody>${d.data.map((b) => html`<${BatchRow} api=${api} b=${b} reload=${reload} />`)}</tbody>
        </table></div>
        ${d.data.length ? '' : html`<p class="muted">No batches.</p>`}
        <${Submit} api=${api} reload=${reload} />`}
    <//></section>`;
}

function BatchRow({ api, b, reload }) {
  const [err, setErr] = useState(null);
  const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = c.completed + c.failed;
  const cancel = async () => {
    try {
      await api.post(`/v1/batches/${encodeURIComponent(b.id)}/cancel`);
      reload();
    } catch (e) {
      setErr(`(${e.status}) ${e.message}`);
    }
  };
  return html`<tr data-batch=${b.id}>
    <td>${b.id}</td><td>${b.endpoint}</td><td class=${`st-${b.status}`}>${b.status}</td>
    <td><progress max=${c.total || 1} value=${done}></progress>
      <span class="small"> ${c.completed}/${c.total} done${c.failed ? `, ${c.failed} failed` : ''}</span></td>
    <td class="small">${when(b.created_at)}</td>
    <td>${b.output_file_id ? html`<button type="button" onClick=${() => download(api, b.output_file_id, `${b.id}-output.jsonl`)}>Output</button>` : ''}
      ${b.error_file_id ? html`<button type="button" class="quiet" onClick=${() => download(api, b.error_file_id, `${b.id}-errors.jsonl`)}>Errors</button>` : ''}
      ${FINAL.has(b.status) ? '' : html`<button type="button" class="danger" onClick=${cancel}>Cancel</button>`}
      ${err ? html`<span class="bad small">${err}</span>` : ''}</td></tr>`;
}

// the file comes with the key in its header, so it is fetched here and handed over as a blob
async function download(api, fileId, name) {
  const resp = await api.request('GET', `/v1/files/${encodeURIComponent(fileId)}/content`);
  const url = URL.createObjectURL(await resp.blob());
  const a = Object.assign(document.createElement('a'), { href: url, download: name });
  a.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function Submit({ api, reload }) {
  const [file, setFile] = useState(null);
  const [endpoint, setEndpoint] = useState(ENDPOINTS[0]);
  const [msg, setMsg] = useState(null);
  const send = async (e) => {
    e.preventDefault();
    try {
      const form = new FormData();
      form.append('purpose', 'batch');
      form.append('file', file);
      const uploaded = await api.upload('/v1/files', form);
      const b = await api.post('/v1/batches', { input_file_id: uploaded.id, endpoint, completion_window: '24h' });
      setMsg({ ok: true, text: `Submitted ${b.id} (${b.status})` });
      reload();
    } catch (err) {
      setMsg({ ok: false, text: `Refused (${err.status}): ${err.message}` });
    }
  };
  return html`<form class="card form" onSubmit=${send}><h3>Submit a batch</h3>
    <label>Requests (JSONL)<input type="file" accept=".jsonl,application/jsonl"
      onChange=${(e) => setFile(e.currentTarget.files[0] || null)} /></label>
    <label>Endpoint<select value=${endpoint} onChange=${(e) => setEndpoint(e.currentTarget.value)}>
      ${ENDPOINTS.map((x) => html`<option>${x}</option>`)}</select></label>
    <div class="toolbar"><button type="submit" disabled=${!file}>Submit</button>
      ${msg ? html`<span class=${msg.ok ? 'ok' : 'bad'}>${msg.text}</span>` : ''}</div></form>`;
}
