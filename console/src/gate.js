// What a view shows instead of its data: loading, the route is not on this server (a real 404), the
// key is missing or wrong (401), or the error the server gave.
import { html } from './html.js';

export function Gate({ res, what, children }) {
  if (res.state === 'ok') return children(res.data);
  if (res.state === 'loading') return html`<p class="muted">Loading ${what}…</p>`;
  if (res.state === 'missing') {
    return html`<p class="notice missing" data-missing=${what}>
      ${what} is not available on this server (${res.path} answered 404).</p>`;
  }
  if (res.state === 'locked') {
    return html`<p class="notice locked">This server needs an API key: enter it above. (${res.error})</p>`;
  }
  return html`<p class="notice error">${what}: ${res.error}</p>`;
}
