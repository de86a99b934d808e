import os
from moto.server import ThreadedMotoServer
srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0); srv.start()
host, port = srv.get_host_and_port()
ep = f"http://{host}:{port}"
os.environ.update(AWS_ENDPOINT_URL=ep, S3_ENDPOINT_URL=ep, AWS_REGION="us-east-1", AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b")
from prx_assets.core.lab import Lab
from prx_assets.core.tables import IMAGES
from prx_assets.core.storage import open_store
try:
    print(open_store("s3://nob/prx/landing").children(""))
except Exception as e: print("STORE", type(e), str(e)[:300])
try:
    print(open_store("s3://nob/prx/landing").put("x", b"1"))
except Exception as e: print("PUT", type(e), str(e)[:300])
try:
    lab = Lab("s3://nob/prx/lab"); lab.ensure(IMAGES); print("lab ok")
except Exception as e: print("LAB", type(e), str(e)[:300])
srv.stop()
