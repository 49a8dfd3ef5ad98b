// Live: the recent time series of /admin/live, per model and device type: output tokens/s,
// requests/s, TTFT and TPOT p50/p95, the queue per priority class, errors/s. The router's cover
// the requests it forwards and its own queue; `polychip serve`'s (scope "server") its one model
// on its device, its scheduler's queue and the requests running in its batch.
import { useState } from 'preact/hooks';
import { html } from '../html.js';
import { Gate } from '../gate.js';
import { usePoll } from '../poll.js';
import { Chart } from '../chart.js';
import { ms, num } from '../format.js';

const PROM_SLOT = 'polychip.console.prometheus';

export function Live({ api }) {
  const [live] = usePoll(api, '/admin/live', 2000);
  const [pick, setPick] = useState('*|*');
  return html`<section>
    <h2>Live</h2>
    <${Gate} res=${live} what="Live metrics">
      ${(d) => html`<${Charts} d=${d} pick=${pick} setPick=${setPick} />`}
    <//>
    <${LinkOut} server=${live.data?.scope === 'server'} />
  </section>`;
}

const keyOf = (s) => `${s.model}|${s.device_type}`;
const labelOf = (s) => (s.model === '*' && s.device_type === '*' ? 'all traffic'
  : `${s.model === '*' ? 'all models' : s.model} on ${s.device_type === '*' ? 'all devices' : s.device_type}`);
const span = (s) => (s < 120 ? `last ${Math.round(s)} s` : `last ${Math.round(s / 60)} min`);
const last = (values) => values.filter((v) => v != null).slice(-1)[0];

function Charts({ d, pick, setPick }) {
  const s = d.series.find((x) => keyOf(x) === pick) || d.series[0];
  const server = d.scope === 'server';
  const t = d.t;
  const queue = Object.entries(d.queue).map(([cls, values]) => ({ label: cls, values }));
  return html`
    <div class="toolbar">
      <label>Show <select value=${keyOf(s)} onChange=${(e) => setPick(e.currentTarget.value)}>
        ${d.series.map((x) => html`<option value=${keyOf(x)}>${labelOf(x)}</option>`)}
      </select></label>
      <span class="muted small">${span(d.t.length * d.step_s)} (up to ${Math.round(d.window_s / 60)} min) in ${d.step_s} s steps</span>
    </div>
    <div class="tiles">
      <div class="tile"><b>${num(last(s.output_tokens_per_s))}</b> output tok/s</div>
      <div class="tile"><b>${num(last(s.requests_per_s), 2)}</b> req/s</div>
      <div class="tile"><b>${ms(last(s.ttft_p50_s))}</b> TTFT p50</div>
      <div class="tile"><b>${ms(last(s.tpot_p50_s))}</b> TPOT p50</div>
      <div class="tile"><b>${last(d.inflight) ?? 0}</b> ${server ? 'running' : 'in flight'}</div>
      <div class="tile"><b>${num(last(s.errors_per_s), 2)}</b> errors/s</div>
    </div>
    <div class="charts">
      <${Chart} title="Output tokens/s" t=${t} lines=${[{ label: 'tok/s', values: s.output_tokens_per_s }]} />
      <${Chart} title="Requests/s" t=${t} lines=${[{ label: 'req/s', values: s.requests_per_s }]} />
      <${Chart} title="Time to first token" t=${t} unit=" ms" scale=${1000} dots=${true}
        lines=${[{ label: 'p50', values: s.ttft_p50_s }, { label: 'p95', values: s.ttft_p95_s }]} />
      <${Chart} title="Time per output token" t=${t} unit=" ms" scale=${1000} dots=${true}
        lines=${[{ label: 'p50', values: s.tpot_p50_s }, { label: 'p95', values: s.tpot_p95_s }]} />
      <${Chart} title=${`Waiting in the ${server ? 'scheduler' : 'router'}, by priority`} t=${t} lines=${queue} />
      <${Chart} title="Errors/s" t=${t} lines=${[{ label: 'errors/s', values: s.errors_per_s }]} />
    </div>
    <p class="small muted">Errors in the window: ${Object.entries(d.errors_by_kind).map(([k, n]) => `${k} ${n}`)
      .join(', ') || 'none'}.</p>`;
}

// For those who run a Prometheus server: a link to it (its address stays in this browser).
function LinkOut({ server }) {
  const [url, setUrl] = useState(localStorage.getItem(PROM_SLOT) || '');
  const save = (v) => {
    setUrl(v);
    if (v) localStorage.setItem(PROM_SLOT, v);
    else localStorage.removeItem(PROM_SLOT);
  };
  const expr = encodeURIComponent(server ? 'rate(polychip_generation_tokens_total[1m])'
    : 'sum by (device_type) (rate(polychip_router_completion_tokens_total[1m]))');
  const ok = /^https?:\/\/[^\s]+$/.test(url);
  return html`<p class="small">
    Raw counters: <a href="/metrics">/metrics</a>.
    Prometheus server: <input class="prom" placeholder="http://prometheus:9090" value=${url}
      onChange=${(e) => save(e.currentTarget.value.trim())} />
    ${ok ? html` <a href=${`${url.replace(/\/$/, '')}/graph?g0.expr=${expr}`} target="_blank"
      rel="noreferrer noopener">open tokens/s there</a>` : ''}</p>`;
}
