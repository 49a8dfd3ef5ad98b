// Room: every host and device (from /admin/devices), every replica with its health, circuit, KV
// cache, queue and prefix-cache figures, its measured speed (prefill tokens/s, TPOT, what a request
// may expect there now), its placement weight with why it is lowered (a device running hot), a
// prefill/decode side's role and KV hand-offs, and a pipeline group's stages (device, layers, step
// time) (from /admin/replicas). On `polychip serve` (no
// /admin/replicas) it shows the one replica from /server_info.
import { html } from '../html.js';
import { Gate } from '../gate.js';
import { usePoll } from '../poll.js';
import { bytes, pct } from '../format.js';

export function Room({ api }) {
  const [replicas] = usePoll(api, '/admin/replicas', 3000);
  if (replicas.state === 'missing') return html`<${ServeRoom} api=${api} />`;
  return html`
    <section>
      <h2>Replicas</h2>
      <${Gate} res=${replicas} what="Replicas">
        ${(d) => html`<${QueueLine} queue=${d.queue} policy=${d.policy} />
          <${ReplicaTable} rows=${d.replicas} />`}
      <//>
    </section>
    <${Devices} api=${api} />`;
}

function ServeRoom({ api }) {
  const [info] = usePoll(api, '/server_info', 3000);
  return html`<section>
    <h2>This server</h2>
    <${Gate} res=${info} what="Server info">
      ${(i) => html`<${ReplicaTable} rows=${[fromServerInfo(i)]} />
        <h3>Device memory</h3>
        <table><thead><tr><th>Device</th><th>Used</th><th>Total</th></tr></thead><tbody>
          ${(i.device_memory || []).map((m) => html`<tr><td>${m.device}</td>
            <td>${bytes(m.total - m.free)}</td><td>${bytes(m.total)}</td></tr>`)}
        </tbody></table>`}
    <//></section>`;
}

// one /server_info as a row of the replica table
function fromServerInfo(i) {
  const d = i.disaggregation;
  const stages = i.pipeline ? i.pipeline.stages.map((s) => [s.device, `${s.layers[0]}-${s.layers[1] - 1}`,
    s.step_seconds]) : [];
  return { name: 'this server', url: location.origin, up: true, model: i.model, version: i.version,
           device: i.device, device_type: i.device_type, info: { ...i, stages }, served: null, inflight: null,
           role: d ? d.mode : null, handoffs: d || null };
}

function QueueLine({ queue, policy }) {
  const parts = Object.entries(queue || {}).map(([cls, n]) => `${cls} ${n}`);
  return html`<p class="muted">Policy ${policy}; waiting in the router: ${parts.join(', ') || 'none'}</p>`;
}

// a field the replica entry carries itself, else the one in the replica's own report (info)
const fig = (r, own, reported) => (r[own] !== undefined ? r[own] : r.info ? r.info[reported] : undefined);

function ReplicaTable({ rows }) {
  return html`<div class="scroll"><table class="replicas">
    <thead><tr><th>Replica</th><th>Device</th><th>Model · version</th><th>Status</th><th>Circuit</th>
      <th>KV cache</th><th>Running</th><th>Waiting</th><th>Prefix hits</th><th>In flight</th>
      <th>Served</th><th>Speed</th><th>Weight</th><th>KV hand-offs</th></tr></thead>
    <tbody>${rows.map((r) => (r.excluded ? html`<tr class="down"><td>${r.name}</td>
        <td colspan="13">excluded: ${r.excluded}</td></tr>` : html`<${ReplicaRow} r=${r} />`))}</tbody>
  </table></div>`;
}

function ReplicaRow({ r }) {
  const kv = fig(r, 'kv_cache_usage', 'kv_usage');
  const status = r.draining ? 'draining' : r.up ? 'up' : `down: ${r.down_reason || 'not checked yet'}`;
  return html`<tr class=${r.up ? 'up' : 'down'} data-replica=${r.name}>
    <td><b>${r.name}</b><div class="muted small">${r.url}</div></td>
    <td><span class="chip">${r.device_type}</span> ${r.device}
      ${r.role ? html` <span class="chip role" data-role=${r.role}>${r.role}</span>` : ''}
      <${Stages} stages=${r.info ? r.info.stages : null} /></td>
    <td>${r.model ?? '–'} · ${r.version ?? '–'}</td>
    <td class="status">${status}${r.incapable ? html`<div class="small">${r.incapable}</div>` : ''}</td>
    <td>${r.circuit ?? html`<span class="muted" title="this router does not report circuit state">n/a</span>`}</td>
    <td><${Bar} value=${kv} /></td>
    <td>${fig(r, 'running', 'num_running') ?? '–'}</td>
    <td>${fig(r, 'waiting', 'num_waiting') ?? '–'}</td>
    <td>${pct(fig(r, 'prefix_hit_rate', 'prefix_cache_hit_rate'))}</td>
    <td>${r.inflight ?? '–'}</td><td>${r.served ?? '–'}</td><td class="speed"><${Speed} r=${r} /></td>
    <td class="weight"><${Weight} r=${r} /></td><td><${Handoffs} h=${r.handoffs} /></td></tr>`;
}

// the replica's moving estimates, and what a typical request may expect there now
function Speed({ r }) {
  const s = r.speed, e = r.expected;
  if (!s) return html`<span class="muted">–</span>`;
  const tps = s.prefill_tokens_per_s == null ? '–' : `${Math.round(s.prefill_tokens_per_s)} tok/s`;
  const tpot = s.tpot_ms == null ? '–' : `${s.tpot_ms.toFixed(1)} ms/tok`;
  const exp = e && e.ttft_ms != null
    ? `expect TTFT ${Math.round(e.ttft_ms)} ms for ${e.prompt_tokens} tokens (${e.source})` : 'not measured yet';
  return html`<span>${tps} · ${tpot}<div class="muted small">${exp}</div></span>`;
}

// its placement weight; lowered while a device runs hot (temperature, limit, throttling)
function Weight({ r }) {
  if (r.weight == null) return html`<span class="muted">–</span>`;
  const temps = (r.device_health || []).filter((h) => h.temperature_c != null)
    .map((h) => `${h.device} ${h.temperature_c} °C`).join(', ');
  return html`<span class=${r.weight < 1 ? 'bad' : ''}>${r.weight}</span>
    ${r.weight_reason ? html`<div class="small">${r.weight_reason}</div>` : ''}
    ${temps && !r.weight_reason ? html`<div class="muted small">${temps}</div>` : ''}`;
}

// a pipeline group's stages: each one's device, layers and mean step time per micro-batch
function Stages({ stages }) {
  if (!stages || !stages.length) return '';
  return html`<div class="stages small">${stages.map(([device, layers, secs], i) => html`<div data-stage=${i}>
    stage ${i}: ${device} · layers ${layers} · ${(secs * 1000).toFixed(1)} ms/step</div>`)}</div>`;
}

// a prefill or decode side's hand-offs: in flight, done (failed), bytes moved and their seconds
function Handoffs({ h }) {
  if (!h) return html`<span class="muted">–</span>`;
  return html`<span class="handoffs">${h.transfers_in_flight} in flight, ${h.transfers_done} done
    ${h.transfers_failed ? `(${h.transfers_failed} failed)` : ''}<div class="muted small">${bytes(h.bytes)} in
    ${Number(h.transfer_seconds).toFixed(1)} s${h.fallbacks ? `, ${h.fallbacks} prefilled here` : ''}</div></span>`;
}

function Bar({ value }) {
  if (value == null) return html`<span class="muted">–</span>`;
  const width = `${Math.min(100, Math.max(0, value * 100)).toFixed(1)}%`;
  return html`<span class="bar" title=${pct(value)}><span style=${{ width }}></span></span>
    <span class="small">${pct(value)}</span>`;
}

function Devices({ api }) {
  const [devices] = usePoll(api, '/admin/devices', 5000);
  return html`<section>
    <h2>Hosts and devices</h2>
    <${Gate} res=${devices} what="Hosts and devices">
      ${(d) => d.hosts.map((h) => html`<${Host} h=${h} />`)}
    <//></section>`;
}

function Host({ h }) {
  return html`<div class="card" data-host=${h.host}>
    <h3>${h.hostname || h.host} <span class=${h.up ? 'ok' : 'bad'}>${h.up ? 'up' : 'down'}</span>
      <span class="muted small">${h.router || ''}</span></h3>
    <div class="scroll"><table>
      <thead><tr><th>Device</th><th>Name</th><th>Plugin</th><th>Memory</th><th>dtypes</th>
        <th>Ready</th><th>Runs</th></tr></thead>
      <tbody>${h.devices.map((d) => html`<tr>
        <td><span class="chip">${d.type}</span> ${d.device}</td><td>${d.name}</td>
        <td>${d.plugin} ${d.plugin_version} <span class="muted small">api ${d.api_version}</span></td>
        <td>${bytes(d.memory_total - d.memory_free)} / ${bytes(d.memory_total)}</td>
        <td class="small">${(d.dtypes || []).join(' ')}</td>
        <td>${d.ready ? 'yes' : `no: ${d.reason}`}</td>
        <td class="small">${[...(d.workloads || []), ...(d.replicas || [])].join(', ') || '–'}</td></tr>`)}
      </tbody></table></div>
    <p class="small muted">Plugins: ${h.plugins.map((p) => `${p.name} ${p.version} (api ${p.api_version})`
      + (p.loaded ? '' : ` not loaded: ${p.reason}`)).join('; ')}</p></div>`;
}
