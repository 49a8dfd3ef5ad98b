// The console's shell: the API key box, the tabs (the URL's #fragment names the view; it never
// holds the key) and the view shown.
import 'uplot/dist/uPlot.min.css';
import './style.css';
import { render } from 'preact';
import { useEffect, useMemo, useState } from 'preact/hooks';
import { html } from './html.js';
import { makeClient } from './api.js';
import { KeyBox } from './keybox.js';
import { Room } from './views/room.js';
import { Live } from './views/live.js';
import { Rollout } from './views/rollout.js';
import { Workloads } from './views/workloads.js';
import { Batches } from './views/batches.js';
import { Chat } from './views/chat.js';

const VIEWS = [
  ['room', 'Room', Room],
  ['live', 'Live', Live],
  ['rollout', 'Rollout', Rollout],
  ['workloads', 'Workloads', Workloads],
  ['batches', 'Batches', Batches],
  ['chat', 'Chat', Chat],
];
const KEY_SLOT = 'polychip.console.key';     // sessionStorage: gone when the tab closes

const viewFromHash = () => {
  const id = location.hash.slice(1);
  return VIEWS.some(([v]) => v === id) ? id : 'room';
};

function App() {
  const [view, setView] = useState(viewFromHash());
  const [key, setKey] = useState(sessionStorage.getItem(KEY_SLOT) || '');
  useEffect(() => {
    const follow = () => setView(viewFromHash());
    addEventListener('hashchange', follow);
    return () => removeEventListener('hashchange', follow);
  }, []);
  const api = useMemo(() => makeClient(key), [key]);
  const saveKey = (k) => {
    if (k) sessionStorage.setItem(KEY_SLOT, k);
    else sessionStorage.removeItem(KEY_SLOT);
    setKey(k);
  };
  const [, , View] = VIEWS.find(([v]) => v === view);
  return html`
    <header>
      <h1><span class="logo"></span>polychip</h1>
      <nav>
        ${VIEWS.map(([id, label]) => html`
          <a href=${`#${id}`} class=${id === view ? 'on' : ''} data-view=${id}>${label}</a>`)}
      </nav>
      <${KeyBox} value=${key} onSave=${saveKey} />
    </header>
    <main id=${`view-${view}`}><${View} key=${`${view}:${key}`} api=${api} /></main>`;
}

render(html`<${App} />`, document.getElementById('app'));
