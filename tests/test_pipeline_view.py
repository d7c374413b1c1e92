"""pp-entry's chat page and the pipeline view it reads, over HTTP on an in-process cluster (the page in a
real browser: tests/test_chat_page.py)."""
from cluster import API_KEY, client_http, start_cluster

AUTH = {"Authorization": f"Bearer {API_KEY}"}  # what the page sends: a client key


async def test_the_chat_page_needs_no_key_and_the_pipeline_view_needs_one(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 3, tmp_path)
    async with client_http(timeout=30) as client:  # a browser's: no member's certificate
        page = await client.get(urls[0] + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<meta name="pp-model" content="stub">' in page.text and "http" not in page.text  # self-contained
        assert (await client.get(urls[0] + "/v1/pipeline")).status_code == 401
        view = (await client.get(urls[0] + "/v1/pipeline", headers=AUTH)).json()
        assert [s["state"] for s in view["stages"]] == ["alive"] * 3 and view["admitting"] is True
        blocks = [s["blocks"] for s in view["stages"]]
        assert blocks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert (await client.get(urls[1] + "/")).status_code == 404  # the page is pp-entry's
    nursery.cancel_scope.cancel()
