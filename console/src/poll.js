// usePoll: GET a path now and every `every` ms while the view is shown; the result says whether the
// route exists on this server (404: "not available"), needs the key (401) or failed otherwise.
import { useCallback, useEffect, useRef, useState } from 'preact/hooks';

export function usePoll(api, path, every = 3000) {
  const [res, setRes] = useState({ state: 'loading' });
  const alive = useRef(true);
  const load = useCallback(async () => {
    if (!path) return;
    try {
      const data = await api.get(path);
      if (alive.current) setRes({ state: 'ok', data, at: Date.now() });
    } catch (e) {
      if (alive.current) setRes({ state: stateOf(e), status: e.status, error: e.message, path });
    }
  }, [api, path]);
  useEffect(() => {
    alive.current = true;
    setRes({ state: 'loading' });
    load();
    const timer = every ? setInterval(load, every) : null;
    return () => {
      alive.current = false;
      if (timer) clearInterval(timer);
    };
  }, [load, every]);
  return [res, load];
}

export function stateOf(e) {
  if (e.status === 404) return 'missing';
  if (e.status === 401) return 'locked';
  return 'error';
}
