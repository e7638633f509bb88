import time
import torch
from _layouts import GradSpec, PlacementSpec, build_grad, reference_stats

def _rank_norm(specs):
    import mfsdp_optim
    gs = [build_grad(s) for s in specs]
    st = mfsdp_optim.grad_stats(gs, count_zeros=True)
    return st.total_norm.item(), st.num_zeros.item(), st.found_inf.item()

def test_smoke(ranks):
    t=time.time(); pool = ranks(4); print("start", time.time()-t)
    specs=[GradSpec((7,3),(2,2),(0,1),(PlacementSpec("R"),PlacementSpec("S",0)), zero_fraction=0.3),
           GradSpec((8,3),(2,2),(1,),(PlacementSpec("S",0),), seed=3),
           GradSpec((8,4),(2,2),(0,1),(PlacementSpec("SS",0,2),PlacementSpec("S",0)), seed=5)]
    t=time.time(); out = pool.run(_rank_norm, specs); print("run", time.time()-t)
    t=time.time(); out = pool.run(_rank_norm, specs); print("run2", time.time()-t)
    print(out, reference_stats(specs, 2.0))
